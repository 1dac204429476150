//! Standby replicas (`gate.standby_replicas`): warm, read-only copies of
//! partitions another gate of the group owns, kept by following their
//! changelog (`state::Follower`), so that a gate taking one over reads only
//! the tail (docs/design.md "Standby replicas").
//!
//! **Where the copies go.** The group assigns partitions with librdkafka's
//! range assignor, which the gate cannot replace or steer: librdkafka has no
//! public API for a custom assignor, and its cooperative and broker-side
//! (KIP-848) assignors know nothing of standbys. So the copies go where the
//! range assignor will put each partition: the range assignor orders static
//! members by `group.instance.id` and gives each a contiguous range, so
//! from the group's current assignment (described by its coordinator) each
//! gate computes who would own every partition if any one member left —
//! its owner first — and keeps a copy of the partitions it is among the
//! first `standby_replicas` of ([`plan`]). A single gate lost (a crash, a
//! node, a deploy) then moves each of its partitions, and those that shift
//! between the others, to a gate already holding them warm. A gate that
//! joins starts cold (nothing is warmed for it before the rebalance).
//!
//! **A dead gate's transaction ended at once.** The same thread keeps the
//! members of the group it saw lately ([`peers`]). A gate that takes partitions
//! over from a member that left the group (its session timed out: killed,
//! frozen, cut off) fences that member's transactional producers before it
//! loads them ([`fence_departed`]): their open transaction is aborted at
//! once, instead of blocking the new owner's reads (read_committed, and the
//! committed offsets) until the transaction timeout. A member is known by
//! its consumer's `client.id` (`kafka::gate_client_id`), unless
//! `[kafka.client]` sets one for every client: then the new owner waits.
//!
//! **Never in the gate's way.** A standby writes only under a lock on what
//! the gate owns (the invoker's ownership, which the gate takes a partition
//! in before it restores it): once the gate holds a partition, no standby
//! write of it is under way or to come, and the standby drops it. A copy is
//! trusted like any local state: it reflects the changelog up to its mark,
//! read_committed, and is resumed from only while in sync more recently than
//! the changelog keeps its tombstones.

use crate::config::Config;
use crate::executor::Owned;
use crate::kafka;
use crate::state::{FollowEvent, Follower, Held, Owners, StateStore, Trust};
use crate::telemetry::Metrics;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// How often the group's assignment is asked for.
const PLAN_EVERY: Duration = Duration::from_secs(3);
/// How often idle copies are checked still at their partition's end (and so
/// in sync), and the copies' lag exported.
const SYNC_EVERY: Duration = Duration::from_secs(15);
/// A wait after an error before trying again.
const RETRY: Duration = Duration::from_secs(2);

/// The partitions each member keeps a copy of: for every partition, the
/// members that would own it if one member left the group (its owner
/// leaving first, then each other member in turn), then the members after
/// its owner in order, without its owner, the first `replicas` of them.
/// `members` is the range assignor's order; `partitions` the intents
/// topic's count. Returns, per member index, its standby partitions.
pub fn plan(members: usize, partitions: i32, replicas: usize) -> Vec<BTreeSet<i32>> {
    let mut out = vec![BTreeSet::new(); members];
    if members < 2 || replicas == 0 {
        return out;
    }
    for p in 0..partitions {
        let owner = range_owner(p, members, partitions);
        let mut keepers: Vec<usize> = Vec::new();
        let add = |m: usize, keepers: &mut Vec<usize>| {
            if m != owner && !keepers.contains(&m) {
                keepers.push(m);
            }
        };
        let leaving = std::iter::once(owner).chain((0..members).filter(|&m| m != owner));
        for gone in leaving {
            let rest = members - 1;
            let index = range_owner(p, rest, partitions);
            // Index among the members without `gone`, back to an index
            // among all of them.
            let m = if index >= gone { index + 1 } else { index };
            add(m, &mut keepers);
        }
        for step in 1..members {
            add((owner + step) % members, &mut keepers);
        }
        for m in keepers.into_iter().take(replicas) {
            out[m].insert(p);
        }
    }
    out
}

/// The member (index in the range assignor's order) that owns `p` of
/// `partitions` among `members`: each gets `partitions / members`, the
/// first `partitions % members` one more, in order.
pub fn range_owner(p: i32, members: usize, partitions: i32) -> usize {
    let n = members as i64;
    let (p, total) = (i64::from(p), i64::from(partitions));
    let (each, extra) = (total / n, total % n);
    // The first `extra` members hold `each + 1`.
    let big = extra * (each + 1);
    if p < big {
        (p / (each + 1)) as usize
    } else if each == 0 {
        (n - 1) as usize
    } else {
        (extra + (p - big) / each) as usize
    }
}

/// The members in the range assignor's order, as the current assignment
/// shows it: by their first `intents` partition (the assignor's order gives
/// each a contiguous range); members given none after them, by member id.
/// And which of them this gate is: the one assigned exactly `mine`.
pub fn order(
    members: &[kafka::Member],
    intents: &str,
    mine: &BTreeSet<i32>,
) -> (Vec<usize>, Option<usize>) {
    let first = |m: &kafka::Member| {
        m.assigned
            .get(intents)
            .and_then(|ps| ps.iter().next().copied())
    };
    let mut idx: Vec<usize> = (0..members.len()).collect();
    idx.sort_by(|&a, &b| {
        let (fa, fb) = (first(&members[a]), first(&members[b]));
        match (fa, fb) {
            (Some(x), Some(y)) => x.cmp(&y),
            (Some(_), None) => std::cmp::Ordering::Less,
            (None, Some(_)) => std::cmp::Ordering::Greater,
            (None, None) => members[a].id.cmp(&members[b].id),
        }
    });
    let me = (!mine.is_empty())
        .then(|| {
            idx.iter()
                .position(|&i| members[i].assigned.get(intents) == Some(mine))
        })
        .flatten();
    (idx, me)
}

/// What the gate owns, as its invoker is told ([`crate::executor::Ownership`]).
struct GateOwners(tokio::sync::watch::Receiver<Owned>);

impl Held for tokio::sync::watch::Ref<'_, Owned> {
    fn owns(&self, p: i32) -> bool {
        self.partitions.contains_key(&p)
    }
}

impl Owners for GateOwners {
    fn hold(&self) -> Box<dyn Held + '_> {
        Box::new(self.0.borrow())
    }
}

impl GateOwners {
    fn owned(&self) -> BTreeSet<i32> {
        self.0.borrow().partitions.keys().copied().collect()
    }
}

/// The members of the group seen stable lately, as this process's standby
/// thread described it (by gate group, then client id): each with its last
/// assignment and when it was last seen.
type Seen = BTreeMap<String, BTreeMap<String, (kafka::Member, Instant)>>;
static PEERS: std::sync::Mutex<Seen> = std::sync::Mutex::new(BTreeMap::new());

/// How long a member stays in [`peers`] after it was last seen: the group's
/// new membership may be described (by the standby thread) before the gate
/// that takes a departed member's partitions over looks, so the last
/// membership alone would miss it.
const PEERS_KEPT: Duration = Duration::from_secs(60);

/// The members of `group` seen in a stable membership within
/// [`PEERS_KEPT`] (empty when none yet).
pub fn peers(group: &str) -> Vec<kafka::Member> {
    let p = PEERS.lock().unwrap_or_else(|e| e.into_inner());
    p.get(group)
        .map(|m| {
            m.values()
                .filter(|(_, at)| at.elapsed() < PEERS_KEPT)
                .map(|(m, _)| m.clone())
                .collect()
        })
        .unwrap_or_default()
}

fn saw_peers(group: &str, members: &[kafka::Member]) {
    let mut p = PEERS.lock().unwrap_or_else(|e| e.into_inner());
    let seen = p.entry(group.to_owned()).or_default();
    let now = Instant::now();
    seen.retain(|_, (_, at)| at.elapsed() < PEERS_KEPT);
    for m in members {
        seen.insert(m.client_id.clone(), (m.clone(), now));
    }
}

/// The instances to fence before loading `taken` (partitions just assigned
/// here): members of `before` (those seen lately) that held some
/// of them and are not in `now`, known by their client id, other than this
/// instance.
pub fn departed<'a>(
    before: &'a [kafka::Member],
    now: &[kafka::Member],
    intents: &str,
    taken: &BTreeSet<i32>,
    me: &str,
) -> BTreeSet<&'a str> {
    let present: BTreeSet<&str> = now.iter().map(|m| m.client_id.as_str()).collect();
    before
        .iter()
        .filter(|m| !present.contains(m.client_id.as_str()))
        .filter(|m| {
            m.assigned
                .get(intents)
                .is_some_and(|ps| !ps.is_disjoint(taken))
        })
        .filter_map(|m| kafka::instance_of_client(&m.client_id))
        .filter(|i| *i != me)
        .collect()
}

/// Fence the transactional producers of the members that left the group
/// holding partitions now assigned here (see the module's text): their open
/// transactions end at once. Best effort: what cannot be described or
/// fenced in time is left to the transaction timeout.
pub async fn fence_departed(cfg: &crate::config::KafkaConfig, taken: &BTreeSet<i32>) {
    let before = peers(&cfg.gate_group);
    if before.is_empty() || taken.is_empty() {
        return;
    }
    let now = {
        let cfg = cfg.clone();
        tokio::task::spawn_blocking(move || {
            let consumer =
                kafka::read_to_end_consumer(&cfg, &format!("{}-standby", cfg.gate_group))?;
            kafka::group_members(&consumer, &cfg.gate_group, Duration::from_secs(5))
        })
        .await
    };
    let now = match now {
        Ok(Ok(Some(now))) => now,
        other => {
            info!(result = ?other.map(|r| r.map(|m| m.map(|m| m.len()))), "could not describe the gate group to fence a departed gate's producers: its open transaction ends at its timeout");
            return;
        }
    };
    let gone = departed(&before, &now, &cfg.topics.intents, taken, &cfg.instance_id);
    tracing::debug!(before = ?before.iter().map(|m| &m.client_id).collect::<Vec<_>>(), now = ?now.iter().map(|m| &m.client_id).collect::<Vec<_>>(), ?gone, "members before and after the assignment");
    for instance in gone {
        let started = Instant::now();
        let ids = kafka::gate_transactional_ids(cfg, instance);
        let fenced = futures::future::join_all(ids.iter().map(|id| async move {
            match tokio::time::timeout(Duration::from_secs(15), kafka::init_txn_producer(cfg, id))
                .await
            {
                Ok(Ok(p)) => {
                    kafka::close_within("a fencing producer", p, Duration::from_secs(5)).await;
                    true
                }
                Ok(Err(e)) => {
                    warn!(transactional_id = %id, error = %e, "could not fence a departed gate's producer: its open transaction ends at its timeout");
                    false
                }
                Err(_) => false,
            }
        }))
        .await;
        info!(
            instance,
            fenced = fenced.iter().filter(|f| **f).count(),
            ms = started.elapsed().as_millis() as u64,
            "a gate left the group holding partitions assigned here: its producers fenced, its open transaction aborted"
        );
    }
}

/// Start this process's standby thread: it keeps the group's members seen
/// lately ([`peers`]) and follows the changelog of the partitions
/// [`plan`] gives this gate (none when `gate.standby_replicas` is 0), until
/// `shutdown`.
pub fn start(
    config: Arc<Config>,
    store: Arc<StateStore>,
    metrics: Arc<Metrics>,
    owned: tokio::sync::watch::Receiver<Owned>,
    trust: Trust,
    shutdown: CancellationToken,
) {
    let owners = Arc::new(GateOwners(owned));
    let spawned = std::thread::Builder::new()
        .name("standby".into())
        .spawn(move || follow(&config, &store, &metrics, &owners, trust, &shutdown));
    if let Err(e) = spawned {
        warn!(error = %e, "could not start the standby replicas' thread: this gate keeps no warm copies");
    }
}

/// The standby thread: follow what [`plan`] gives this gate until shutdown.
fn follow(
    config: &Config,
    store: &StateStore,
    metrics: &Metrics,
    owners: &Arc<GateOwners>,
    trust: Trust,
    shutdown: &CancellationToken,
) {
    let k = &config.kafka;
    let group = format!("{}-standby", k.gate_group);
    while !shutdown.is_cancelled() {
        let mut f = match Follower::standby(k, &group, owners.clone()) {
            Ok(f) => f,
            Err(e) => {
                warn!(error = %e, "standby replicas: could not create the changelog reader (retrying)");
                std::thread::sleep(RETRY);
                continue;
            }
        };
        if let Err(e) = run(config, store, metrics, owners, &trust, shutdown, &mut f) {
            warn!(error = %e, "standby replicas: following the changelog failed; starting again");
            std::thread::sleep(RETRY);
        }
        for p in f.partitions().collect::<Vec<_>>() {
            metrics.standby(p, None);
        }
    }
}

#[derive(Debug, thiserror::Error)]
enum StandbyError {
    #[error("Kafka")]
    Kafka(#[from] rdkafka::error::KafkaError),
    #[error("restore")]
    Restore(#[from] crate::state::RestoreError),
    #[error("state")]
    State(#[from] crate::state::StateError),
}

fn run(
    config: &Config,
    store: &StateStore,
    metrics: &Metrics,
    owners: &GateOwners,
    trust: &Trust,
    shutdown: &CancellationToken,
    f: &mut Follower,
) -> Result<(), StandbyError> {
    let k = &config.kafka;
    let replicas = config.gate.standby_replicas;
    let mut planned_at: Option<Instant> = None;
    let mut synced_at = Instant::now();
    let mut want: BTreeSet<i32> = BTreeSet::new();
    let mut partitions: Option<i32> = None;
    while !shutdown.is_cancelled() {
        if planned_at.is_none_or(|t| t.elapsed() >= PLAN_EVERY) {
            planned_at = Some(Instant::now());
            if partitions.is_none() {
                partitions = kafka::partition_counts(k, &[k.topics.intents.as_str()])
                    .ok()
                    .and_then(|c| c.first().map(|&n| n as i32));
            }
            let mine = owners.owned();
            // Not described (a rebalance under way, the coordinator away):
            // the copies stay as they are until it is.
            let members = partitions.and_then(|_| {
                kafka::group_members(f.consumer(), &k.gate_group, Duration::from_secs(5))
                    .inspect_err(|e| tracing::debug!(error = %e, "standby replicas: could not describe the gate group"))
                    .ok()
                    .flatten()
            });
            if let Some(m) = &members {
                saw_peers(&k.gate_group, m);
            }
            if let (Some(n), Some(members)) = (partitions, members) {
                let (order, me) = order(&members, &k.topics.intents, &mine);
                // Not found (this gate owns nothing, or the group moved on
                // since): the copies stay as they are until it is.
                if let Some(me) = me {
                    let plans = plan(order.len(), n, replicas);
                    want = plans[me].difference(&mine).copied().collect();
                } else if replicas == 0 {
                    want.clear();
                }
            }
            let now: BTreeSet<i32> = f.partitions().collect();
            for p in now.difference(&want) {
                info!(partition = p, "standby replica dropped");
                f.stop(store, *p)?;
                metrics.standby(*p, None);
            }
            for p in want.difference(&now) {
                if mine.contains(p) {
                    continue;
                }
                f.start(store, *p, trust)?;
                if f.partitions().any(|q| q == *p) {
                    info!(partition = p, "standby replica started");
                    metrics.standby(*p, Some(0));
                }
            }
        }
        for ev in f.poll(store, Duration::from_millis(200))? {
            match ev {
                FollowEvent::CaughtUp(p) => {
                    if let Some(&(_, at)) = f.in_sync_since(0).iter().find(|(q, _)| *q == p) {
                        f.mark_in_sync(store, p, at)?;
                    }
                }
                FollowEvent::StartedOver(p, why) => {
                    info!(
                        partition = p,
                        reason = why.label(),
                        "standby replica restored from the changelog's start"
                    );
                }
            }
        }
        if synced_at.elapsed() >= SYNC_EVERY {
            synced_at = Instant::now();
            f.check_at_end();
            for (p, at) in f.in_sync_since(0) {
                f.mark_in_sync(store, p, at)?;
            }
            let lags: BTreeMap<i32, i64> = f
                .partitions()
                .collect::<Vec<_>>()
                .into_iter()
                .filter_map(|p| f.lag(p).map(|l| (p, l)))
                .collect();
            for (p, lag) in lags {
                metrics.standby(p, Some(lag));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The range assignor's ranges: 10 over 3 is 4, 3, 3.
    #[test]
    fn range_owner_is_the_range_assignors() {
        let owners: Vec<usize> = (0..10).map(|p| range_owner(p, 3, 10)).collect();
        assert_eq!(owners, vec![0, 0, 0, 0, 1, 1, 1, 2, 2, 2]);
        // Fewer partitions than members: one each, the rest none.
        let owners: Vec<usize> = (0..2).map(|p| range_owner(p, 3, 2)).collect();
        assert_eq!(owners, vec![0, 1]);
        assert_eq!(range_owner(0, 1, 4), 0);
    }

    /// Every partition's copy is on the member that owns it after its own
    /// owner leaves: the gate a crash hands it to.
    #[test]
    fn one_copy_goes_where_the_range_assignor_moves_a_partition() {
        for (members, partitions) in [(2, 4), (3, 12), (3, 10), (4, 6), (5, 16)] {
            let plans = plan(members, partitions, 1);
            for p in 0..partitions {
                let owner = range_owner(p, members, partitions);
                let keepers: Vec<usize> = (0..members).filter(|&m| plans[m].contains(&p)).collect();
                assert_eq!(keepers.len(), 1, "{members} members, p{p}");
                assert!(!plans[owner].contains(&p), "never the owner");
                let after = range_owner(p, members - 1, partitions);
                let heir = if after >= owner { after + 1 } else { after };
                assert_eq!(
                    keepers,
                    vec![heir],
                    "{members} members, {partitions} partitions, p{p}"
                );
            }
        }
    }

    /// Two gates: each keeps the other's partitions. One gate: nothing.
    /// More copies than other members: every other member keeps one.
    #[test]
    fn small_groups_keep_every_partition_warm() {
        let plans = plan(2, 4, 1);
        assert_eq!(plans[0], BTreeSet::from([2, 3]));
        assert_eq!(plans[1], BTreeSet::from([0, 1]));
        assert!(plan(1, 4, 3)[0].is_empty());
        assert!(plan(3, 6, 0).iter().all(BTreeSet::is_empty));
        let all = plan(3, 6, 5);
        for p in 0..6 {
            let owner = range_owner(p, 3, 6);
            for (m, ps) in all.iter().enumerate() {
                assert_eq!(ps.contains(&p), m != owner, "p{p} member {m}");
            }
        }
    }

    /// Whichever one gate leaves, every partition lands on its owner or on
    /// a gate holding it warm: with one copy where a departure moves each
    /// partition to one place only, with two elsewhere.
    #[test]
    fn copies_cover_any_one_gate_leaving() {
        for (members, partitions, replicas) in [
            (3, 12, 1),
            (4, 12, 1),
            (3, 10, 2),
            (4, 10, 2),
            (5, 16, 2),
            (6, 7, 2),
        ] {
            let plans = plan(members, partitions, replicas);
            for gone in 0..members {
                for p in 0..partitions {
                    let after = range_owner(p, members - 1, partitions);
                    let lands = if after >= gone { after + 1 } else { after };
                    let owner = range_owner(p, members, partitions);
                    assert!(
                        lands == owner || plans[lands].contains(&p),
                        "{members} gates, {partitions} partitions, {replicas} copies: gate {gone} leaves, p{p} lands on {lands} cold"
                    );
                }
            }
        }
    }

    #[test]
    fn a_member_that_left_holding_partitions_taken_here_is_fenced() {
        let member = |client: &str, ps: &[i32]| kafka::Member {
            id: format!("{client}-id"),
            client_id: client.into(),
            assigned: BTreeMap::from([("i".to_owned(), ps.iter().copied().collect())]),
        };
        let before = vec![
            member("stepgate-gate:a", &[0, 1]),
            member("stepgate-gate:b", &[2, 3]),
            member("stepgate-gate:c", &[4, 5]),
            member("rdkafka", &[6]),
        ];
        let now = vec![
            member("stepgate-gate:b", &[0, 1, 2, 3]),
            member("stepgate-gate:c", &[4, 5, 6]),
        ];
        let taken = BTreeSet::from([0, 1, 6]);
        // a left holding 0 and 1; the member named rdkafka cannot be told.
        assert_eq!(
            departed(&before, &now, "i", &taken, "b"),
            BTreeSet::from(["a"])
        );
        // Restarted with the same instance (in the group again): not fenced.
        let back = vec![
            member("stepgate-gate:a", &[]),
            member("stepgate-gate:b", &[0, 1, 2, 3]),
        ];
        assert!(departed(&before, &back, "i", &taken, "b").is_empty());
        // Partitions not taken here: another gate's business.
        assert!(departed(&before, &now, "i", &BTreeSet::from([4]), "c").is_empty());
        // Never itself.
        assert!(departed(&before, &now, "i", &taken, "a").is_empty());
    }

    #[test]
    fn the_order_is_read_from_the_assignment_and_this_gate_found_by_its_own() {
        let member = |id: &str, ps: &[i32]| kafka::Member {
            id: id.into(),
            client_id: "rdkafka".into(),
            assigned: BTreeMap::from([("i".to_owned(), ps.iter().copied().collect())]),
        };
        let members = vec![
            member("z", &[0, 1]),
            member("a", &[4, 5]),
            member("m", &[2, 3]),
            member("b", &[]),
        ];
        let (order, me) = order(&members, "i", &BTreeSet::from([2, 3]));
        assert_eq!(order, vec![0, 2, 1, 3]);
        assert_eq!(me, Some(1));
        let (_, none) = super::order(&members, "i", &BTreeSet::new());
        assert_eq!(
            none, None,
            "a gate with no partitions cannot tell which it is"
        );
    }
}
