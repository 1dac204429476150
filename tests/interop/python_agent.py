#!/usr/bin/env python3
"""Drive stepgate from Python's confluent-kafka, a client nobody here wrote.

Publishes the intent examples of schemas/intent.v1.json (with a fresh workflow id
and the given tool) using the murmur2 partitioner (not librdkafka's default), plus
a rephrased repeat of each, checks that each landed in the partition Kafka's Java
clients pick (stepgate's canonical partitioner, re-implemented below), then reads
the results topic and checks that every call is answered in its intent's
partition, and that each repeat is the original answer but for call_id and
deduplicated.

usage: python_agent.py BROKERS INTENTS_TOPIC RESULTS_TOPIC SCHEMAS_DIR TOOL
"""
import json
import sys
import time
import uuid

from confluent_kafka import Consumer, Producer, TopicPartition

brokers, intents, results, schemas_dir, tool = sys.argv[1:6]
with open(f"{schemas_dir}/intent.v1.json") as f:
    examples = json.load(f)["examples"]
with open(f"{schemas_dir}/result.v1.json") as f:
    required = json.load(f)["required"]



def murmur2(data: bytes) -> int:
    """Kafka's Utils.murmur2 (Java), as an unsigned 32-bit value."""
    m, r, mask = 0x5BD1E995, 24, 0xFFFFFFFF
    h = (0x9747B28C ^ len(data)) & mask
    n4 = len(data) // 4
    for i in range(n4):
        k = int.from_bytes(data[4 * i:4 * i + 4], "little")
        k = (k * m) & mask
        k ^= k >> r
        k = (k * m) & mask
        h = ((h * m) & mask) ^ k
    tail = data[4 * n4:]
    if len(tail) == 3:
        h ^= tail[2] << 16
    if len(tail) >= 2:
        h ^= tail[1] << 8
    if len(tail) >= 1:
        h ^= tail[0]
        h = (h * m) & mask
    h ^= h >> 13
    h = (h * m) & mask
    h ^= h >> 15
    return h


def owner(workflow_id: str, partitions: int) -> int:
    """stepgate's canonical partition: Java's toPositive(murmur2(key)) % n."""
    return (murmur2(workflow_id.encode()) & 0x7FFFFFFF) % partitions


# Reference values from Kafka's own Utils.murmur2 (see crates/stepgate-client/src/contract/partition.rs).
assert murmur2(b"21") == (-973932308) & 0xFFFFFFFF
assert owner("order-7781", 7) == 3 and owner("abcd", 7) == 5 and owner("", 4) == 1

run = uuid.uuid4().hex[:8]
consumer = Consumer({
    "bootstrap.servers": brokers,
    "group.id": f"py-interop-{run}",
    "enable.auto.commit": False,
    "isolation.level": "read_committed",
})
n_parts = len(consumer.list_topics(results, timeout=10).topics[results].partitions)
start = []
for p in range(n_parts):
    _, high = consumer.get_watermark_offsets(TopicPartition(results, p), timeout=10)
    start.append(TopicPartition(results, p, high))
consumer.assign(start)

producer = Producer({"bootstrap.servers": brokers, "partitioner": "murmur2_random", "linger.ms": 0})
n_intent_parts = len(producer.list_topics(intents, timeout=10).topics[intents].partitions)
sent = {}  # call_id -> partition the intent landed in


def publish(intent):
    delivered = {}

    def on_delivery(err, msg):
        if err is not None:
            raise SystemExit(f"produce failed: {err}")
        delivered["partition"] = msg.partition()

    producer.produce(intents, key=intent["workflow_id"], value=json.dumps(intent), on_delivery=on_delivery)
    producer.flush(10)
    sent[intent["call_id"]] = delivered["partition"]
    expected = owner(intent["workflow_id"], n_intent_parts)
    assert delivered["partition"] == expected, \
        f"{intent['workflow_id']}: murmur2_random put it in {delivered['partition']}, Java's partitioner in {expected}"


pairs = []
for i, example in enumerate(examples):
    first = dict(example, workflow_id=f"py-{run}-{i}", tool=tool, call_id=f"py-{run}-{i}-first")
    publish(first)
    repeat = dict(first, call_id=f"py-{run}-{i}-repeat",
                  arguments=dict(first["arguments"], subject="Your order is confirmed"))
    publish(repeat)
    pairs.append((first["call_id"], repeat["call_id"]))

answers = {}
deadline = time.time() + 60
while len(answers) < len(sent) and time.time() < deadline:
    msg = consumer.poll(0.5)
    if msg is None or msg.error():
        continue
    value = json.loads(msg.value())
    if value.get("call_id") in sent:
        answers[value["call_id"]] = (msg.partition(), value)
consumer.close()

missing = set(sent) - set(answers)
assert not missing, f"no answer for {missing}"
for call_id, (partition, value) in answers.items():
    assert partition == sent[call_id], f"{call_id}: answered in partition {partition}, intent was in {sent[call_id]}"
    for field in required:
        assert field in value, f"{call_id}: `{field}` missing from {value}"
    assert value["status"] == "ok", value
for first_id, repeat_id in pairs:
    first, repeat = answers[first_id][1], answers[repeat_id][1]
    assert first["deduplicated"] is False and repeat["deduplicated"] is True, (first, repeat)
    assert dict(first, call_id=None, deduplicated=None) == dict(repeat, call_id=None, deduplicated=None), (first, repeat)
print(f"python interop: {len(sent)} intents from confluent-kafka (murmur2 partitioner), "
      f"all answered in their partition, repeats identical")
