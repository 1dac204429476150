import sys
from confluent_kafka import Producer
brokers, acked = sys.argv[1], sys.argv[2]
p = Producer({"bootstrap.servers": brokers, "transactional.id": "exp-txn-rd", "linger.ms": 0,
              "message.timeout.ms": 5000, "transaction.timeout.ms": 60000})
p.init_transactions(10)
with open(acked, "a") as out:
    i = 0
    try:
        while True:
            p.begin_transaction()
            p.produce("exp", key="k", value=str(i), partition=0)
            p.commit_transaction(5)
            out.write(f"{i}\n"); out.flush()
            i += 1
    except Exception as e:
        print("producer stopped:", e)
