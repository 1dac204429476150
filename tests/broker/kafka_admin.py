"""SCRAM users and ACLs on the test broker, for tests/broker/acls.rs.

    python3 kafka_admin.py check          # exit 3 when the broker has no authorizer
    python3 kafka_admin.py users  < {"name": "password", ...}
    python3 kafka_admin.py acls   < [{"principal": "User:x", "resource": "topic",
                                       "name": "t", "pattern": "literal" | "prefixed",
                                       "operation": "read"}, ...]

It connects to the SASL_SSL listener as its admin (a super user), from the
file `KAFKA_SASL_SSL_ENV` names (deploy/local/kafka.sh writes it), through
librdkafka's Admin API (confluent-kafka): rust-rdkafka does not wrap these
calls, and Kafka's own kafka-acls.sh is not among the jars kafka.sh fetches.
"""

from __future__ import annotations

import json
import os
import sys

from confluent_kafka.admin import (
    AclBinding,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ConfigResource,
    ResourcePatternType,
    ResourceType,
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialUpsertion,
)


def admin() -> AdminClient:
    env = {}
    with open(os.environ["KAFKA_SASL_SSL_ENV"]) as f:
        for line in f:
            if "=" in line and not line.startswith("#"):
                k, v = line.rstrip("\n").split("=", 1)
                env[k] = v
    return AdminClient({
        "bootstrap.servers": env["KAFKA_SASL_SSL_BROKERS"],
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": env["KAFKA_SASL_MECHANISM"],
        "sasl.username": env["KAFKA_SASL_USERNAME"],
        "sasl.password": env["KAFKA_SASL_PASSWORD"],
        "ssl.ca.location": env["KAFKA_SSL_CA_LOCATION"],
    })


def check(a: AdminClient) -> int:
    """0 when the brokers run an authorizer, 3 when not."""
    broker = next(iter(a.list_topics(timeout=30).brokers))
    resource = ConfigResource(ResourceType.BROKER, str(broker))
    configs = a.describe_configs([resource], request_timeout=30)[resource].result()
    entry = configs.get("authorizer.class.name")
    return 0 if entry is not None and entry.value else 3


def users(a: AdminClient, spec: dict) -> None:
    info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 4096)
    upserts = [UserScramCredentialUpsertion(name, info, password.encode())
               for name, password in spec.items()]
    for f in a.alter_user_scram_credentials(upserts, request_timeout=30).values():
        f.result()


def acls(a: AdminClient, spec: list) -> None:
    bindings = [AclBinding(ResourceType[s["resource"].upper()], s["name"],
                           ResourcePatternType[s["pattern"].upper()], s["principal"], "*",
                           AclOperation[s["operation"].upper()], AclPermissionType.ALLOW)
                for s in spec]
    for f in a.create_acls(bindings, request_timeout=30).values():
        f.result()


def main() -> int:
    what = sys.argv[1]
    a = admin()
    if what == "check":
        return check(a)
    spec = json.load(sys.stdin)
    {"users": users, "acls": acls}[what](a, spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
