"""Which acknowledged commits of txn_commit_loop.py a read_committed reader sees.

usage: read_committed_check.py BROKERS ACKED_FILE
"""
import sys

from confluent_kafka import Consumer, TopicPartition

brokers, acked_file = sys.argv[1:3]
acked = [int(line) for line in open(acked_file)]
c = Consumer({"bootstrap.servers": brokers, "group.id": "repro-reader", "enable.auto.commit": False,
              "isolation.level": "read_committed", "enable.partition.eof": True})
c.assign([TopicPartition("exp", 0, 0)])
seen = set()
while True:
    m = c.poll(10)
    if m is None:
        break  # nothing more within 10 s: the last stable offset stands still
    if m.error():
        if m.error().code() == -191:  # _PARTITION_EOF
            break
        continue
    seen.add(int(m.value()))
c.close()
lost = [i for i in acked if i not in seen]
print(f"acknowledged commits: {len(acked)}, visible to read_committed: {len(seen)}, "
      f"acknowledged but not visible: {len(lost)} {lost[:5]}")
