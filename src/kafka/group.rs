//! The gate group's members and what each is assigned, as the group
//! coordinator describes them: standby replicas are placed from it
//! (`gate::standby`).

use rdkafka::client::ClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::KafkaError;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

/// One member of a consumer group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// The member id the coordinator gave it.
    pub id: String,
    /// Its client's `client.id`.
    pub client_id: String,
    /// Its assignment: partitions by topic.
    pub assigned: BTreeMap<String, BTreeSet<i32>>,
}

/// The members of `group` and their assignments, when the group is stable
/// (None while it rebalances, or when it has no members). Blocking.
pub fn group_members<C: ClientContext + ConsumerContext>(
    consumer: &BaseConsumer<C>,
    group: &str,
    timeout: Duration,
) -> Result<Option<Vec<Member>>, KafkaError> {
    let list = consumer.fetch_group_list(Some(group), timeout)?;
    let Some(info) = list.groups().iter().find(|g| g.name() == group) else {
        return Ok(None);
    };
    if info.state() != "Stable" || info.members().is_empty() {
        return Ok(None);
    }
    let mut members = Vec::new();
    for m in info.members() {
        let Some(assigned) = m.assignment().and_then(parse_assignment) else {
            return Ok(None);
        };
        members.push(Member {
            id: m.id().to_owned(),
            client_id: m.client_id().to_owned(),
            assigned,
        });
    }
    Ok(Some(members))
}

/// A consumer protocol assignment (`ConsumerProtocolAssignment`, any
/// version: `version: int16, [topic: string, [partition: int32]],
/// user_data: bytes`); None when it does not parse.
pub fn parse_assignment(bytes: &[u8]) -> Option<BTreeMap<String, BTreeSet<i32>>> {
    let mut r = Reader(bytes);
    let _version = r.i16()?;
    let topics = r.i32()?;
    let mut out = BTreeMap::new();
    for _ in 0..topics.max(0) {
        let len = r.i16()?;
        let name = std::str::from_utf8(r.take(usize::try_from(len).ok()?)?).ok()?;
        let n = r.i32()?;
        let mut parts = BTreeSet::new();
        for _ in 0..n.max(0) {
            parts.insert(r.i32()?);
        }
        out.insert(name.to_owned(), parts);
    }
    Some(out)
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    fn i16(&mut self) -> Option<i16> {
        Some(i16::from_be_bytes(self.take(2)?.try_into().ok()?))
    }

    fn i32(&mut self) -> Option<i32> {
        Some(i32::from_be_bytes(self.take(4)?.try_into().ok()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(topics: &[(&str, &[i32])]) -> Vec<u8> {
        let mut b = 1i16.to_be_bytes().to_vec();
        b.extend((topics.len() as i32).to_be_bytes());
        for (t, ps) in topics {
            b.extend((t.len() as i16).to_be_bytes());
            b.extend(t.as_bytes());
            b.extend((ps.len() as i32).to_be_bytes());
            for p in *ps {
                b.extend(p.to_be_bytes());
            }
        }
        b.extend((-1i32).to_be_bytes());
        b
    }

    #[test]
    fn an_assignment_parses_and_a_truncated_one_does_not() {
        let b = encode(&[("x.intents", &[0, 1]), ("x.progress", &[0, 1])]);
        let a = parse_assignment(&b).unwrap();
        assert_eq!(a["x.intents"], BTreeSet::from([0, 1]));
        assert_eq!(a.len(), 2);
        assert_eq!(parse_assignment(&b[..b.len() - 9]), None);
        assert_eq!(parse_assignment(&[]), None);
        // An empty assignment (a member given nothing).
        assert_eq!(parse_assignment(&encode(&[])), Some(BTreeMap::new()));
    }
}
