//! The applied mark: per intents partition, the first offset not yet
//! applied (consumed and decided), which the group's committed offset carries
//! in its metadata with the intents topic's partition count. The committed
//! offset may lag it (held at an unanswered fast-path call or a deferred step
//! not settled), and intents re-read below it are not applied twice.

/// The offset-metadata tag of the mark.
const APPLIED_TAG: &str = "stepgate-applied:";

/// The committed offset's metadata, read back: either part may be missing
/// (the partition count is written once known, and another tool may commit
/// the group's offsets).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct AppliedMark {
    pub applied: Option<i64>,
    /// The intents topic's partition count the offset was committed with.
    pub partitions: Option<i32>,
}

impl AppliedMark {
    /// The metadata of a committed offset: `stepgate-applied:<n> partitions:<m>`.
    pub fn encode(applied: i64, partitions: Option<i32>) -> String {
        match partitions {
            Some(n) => format!("{APPLIED_TAG}{applied} partitions:{n}"),
            None => format!("{APPLIED_TAG}{applied}"),
        }
    }

    /// [`AppliedMark::encode`] read back.
    pub fn parse(meta: &str) -> AppliedMark {
        let Some(rest) = meta.strip_prefix(APPLIED_TAG) else {
            return AppliedMark::default();
        };
        let mut parts = rest.split_whitespace();
        let applied = parts.next().and_then(|s| s.parse().ok());
        let partitions = parts
            .find_map(|p| p.strip_prefix("partitions:"))
            .and_then(|s| s.parse().ok());
        AppliedMark {
            applied,
            partitions,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::AppliedMark;

    #[test]
    fn the_mark_reads_back_as_written() {
        let m = AppliedMark::parse(&AppliedMark::encode(42, Some(8)));
        assert_eq!((m.applied, m.partitions), (Some(42), Some(8)));
        let m = AppliedMark::parse(&AppliedMark::encode(7, None));
        assert_eq!((m.applied, m.partitions), (Some(7), None));
        assert_eq!(AppliedMark::parse(""), AppliedMark::default());
        assert_eq!(AppliedMark::parse("another tool's"), AppliedMark::default());
    }
}
