//! Partition ownership: the one canonical partitioner.
//!
//! Dedup holds within a partition, so every intent of a workflow must land in
//! the same one whatever client published it. Kafka's Java clients hash a keyed
//! record with murmur2 (`Utils.toPositive(Utils.murmur2(key)) % partitions`);
//! librdkafka's default (`consistent_random`, CRC32) does not, so a Java retry
//! and a librdkafka retry of one step landed in different partitions and ran the
//! tool twice. Every stepgate client uses this function, and librdkafka-based
//! clients of other languages set `partitioner=murmur2_random` (the same hash for
//! non-null keys).

/// The partition that owns `workflow_id` among `partitions`: Java's default
/// partitioner on the UTF-8 bytes of the id. `partitions` must be ≥ 1; 0 or
/// less yields partition 0 rather than a division by zero.
pub fn partition_for(workflow_id: &str, partitions: i32) -> i32 {
    if partitions <= 0 {
        return 0;
    }
    // `toPositive` clears the sign bit (it is not `abs`).
    ((murmur2(workflow_id.as_bytes()) & 0x7fff_ffff) % partitions as u32) as i32
}

/// Kafka's `org.apache.kafka.common.utils.Utils.murmur2`: MurmurHash2, 32-bit,
/// seed `0x9747b28c`, words read little-endian, as a signed Java `int`.
pub fn murmur2(data: &[u8]) -> u32 {
    const SEED: u32 = 0x9747_b28c;
    const M: u32 = 0x5bd1_e995;
    const R: u32 = 24;
    // Java computes `seed ^ length` on ints: the length is taken modulo 2^32.
    let mut h: u32 = SEED ^ (data.len() as u32);
    let mut chunks = data.chunks_exact(4);
    for c in &mut chunks {
        let mut k = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> R;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let tail = chunks.remainder();
    // Java's fall-through switch on `length % 4`; bytes are sign-agnostic here
    // because each is masked with 0xff.
    if tail.len() == 3 {
        h ^= u32::from(tail[2]) << 16;
    }
    if tail.len() >= 2 {
        h ^= u32::from(tail[1]) << 8;
    }
    if !tail.is_empty() {
        h ^= u32::from(tail[0]);
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Produced with Kafka's own code (kafka-clients 4.4.0, the jar that
    /// `deploy/local/kafka.sh start` fetches): for each key, `Utils.murmur2` of
    /// its UTF-8 bytes, then `Utils.toPositive(h) % n` — checked equal to
    /// `BuiltInPartitioner.partitionForKey(bytes, n)`, the producer's default —
    /// for n = 1, 3, 4, 7, 12, 100. (`"21"` → -973932308 is also a published
    /// vector of Kafka's `UtilsTest`.)
    const JAVA: &[(&str, i32, [i32; 6])] = &[
        ("", 275646681, [0, 0, 1, 2, 9, 81]),
        ("a", -1563381124, [0, 1, 0, 5, 4, 24]),
        ("ab", 316155434, [0, 2, 2, 0, 2, 34]),
        ("abc", 479470107, [0, 0, 3, 4, 3, 7]),
        ("abcd", -1323649548, [0, 2, 0, 5, 8, 0]),
        ("abcde", 461995741, [0, 1, 1, 4, 1, 41]),
        ("order-7781", -1075558966, [0, 1, 2, 3, 10, 82]),
        ("wf-0", 2005677670, [0, 1, 2, 3, 10, 70]),
        ("wf-1", -927987858, [0, 2, 2, 2, 2, 90]),
        ("py-3f2a9c1e-0", 1913363340, [0, 0, 0, 0, 0, 40]),
        (
            "thread-\u{e9}t\u{e9}-\u{2603}",
            336591892,
            [0, 1, 0, 0, 4, 92],
        ),
        ("21", -973932308, [0, 0, 0, 3, 0, 40]),
        ("foobar", -790332482, [0, 0, 2, 0, 6, 66]),
        ("kafka", -798503068, [0, 1, 0, 3, 4, 80]),
        (
            "a-very-long-workflow-id-0123456789-0123456789-0123456789-0123456789",
            -240720344,
            [0, 0, 0, 5, 0, 4],
        ),
    ];
    const NS: [i32; 6] = [1, 3, 4, 7, 12, 100];

    #[test]
    fn murmur2_matches_kafkas_java_clients() {
        for (key, hash, parts) in JAVA {
            assert_eq!(murmur2(key.as_bytes()) as i32, *hash, "murmur2({key:?})");
            for (n, p) in NS.iter().zip(parts) {
                assert_eq!(partition_for(key, *n), *p, "{key:?} over {n} partitions");
            }
        }
        // Every byte value, so the sign handling of the tail bytes is covered
        // (Java: `Utils.murmur2(new byte[]{0, 1, …, 254})`).
        let all: Vec<u8> = (0..=254).collect();
        assert_eq!(murmur2(&all) as i32, 1542706800);
    }

    #[test]
    fn partition_is_always_in_range() {
        for n in [1, 2, 5, 64, i32::MAX] {
            for key in ["", "x", "order-7781", "\u{2603}\u{2603}"] {
                let p = partition_for(key, n);
                assert!((0..n).contains(&p), "{key:?} over {n}: {p}");
            }
        }
        assert_eq!(partition_for("w", 0), 0);
        assert_eq!(partition_for("w", -3), 0);
    }
}
