/**
 * Intents out, answers in, over Kafka (`@confluentinc/kafka-javascript`).
 *
 * One `KafkaClient` serves any number of calls at once: each call registers a
 * waiter under its whole step key and call id, publishes its intent to its
 * workflow's murmur2 partition with an idempotent producer, and waits; one
 * `read_committed` consumer reads the answers of the partitions the client's
 * workflows live in and hands each answer to the waiters of exactly that key.
 */
import { createRequire } from "node:module";
import type * as RdKafka from "@confluentinc/kafka-javascript";

import { answerFromRecord, MalformedAnswer, type Answer, type Held, type Outcome } from "./answer.js";
import { StepgateClosed, StepgateConfigError, StepgatePublishError } from "./errors.js";
import { partitionFor } from "./murmur2.js";
import { checkCall, freshCallId, intentRecord, type CallOptions, type StepCall, type Transport } from "./transport.js";
import { Workflow } from "./workflow.js";

// A CommonJS native module: loaded with require so that importing this file's
// types costs nothing where it is not installed.
const require = createRequire(import.meta.url);

/** How to reach stepgate over Kafka. */
export interface KafkaClientOptions {
  /** Bootstrap servers, e.g. `127.0.0.1:9092`. */
  brokers: string;
  /** The intents topic. Default `stepgate.intents`. */
  intents?: string;
  /** The results topic. Default `stepgate.results`. */
  results?: string;
  /** The approvals topic (held calls), used when it exists. Default `stepgate.approvals`; `null`: never. */
  approvals?: string | null;
  /** More librdkafka settings for both producer and consumer (security, client.id, …). */
  config?: Record<string, string | number | boolean>;
  /** How long to wait for metadata and watermarks. Default 10 s. */
  metadataTimeoutMs?: number;
  /** A call that hears nothing this long publishes the same intent again (the same step: harmless). Default 10 s. */
  republishAfterMs?: number;
  /** Default `CallOptions.timeoutMs`. Default 60 s. */
  timeoutMs?: number;
}

type Timings = Required<Pick<KafkaClientOptions, "metadataTimeoutMs" | "republishAfterMs" | "timeoutMs">>;

type Settle = (outcome: Answer | Held | Error) => void;

interface Waiter {
  settle: Settle;
  /** Set when the call asked to hear of a hold (`onHeld: "return"`). */
  onHeld?: (event: Record<string, unknown>) => void;
}

/** The dispatch key of an answer or a waiter: the whole step key and the call id. */
function keyOf(workflowId: string, stepIndex: number, tool: string, attempt: number, callId: string | null): string {
  return JSON.stringify([workflowId, stepIndex, tool, attempt, callId]);
}

function promisify<T>(f: (cb: (err: unknown, value: T) => void) => void): Promise<T> {
  return new Promise((resolve, reject) => f((err, value) => (err ? reject(err) : resolve(value))));
}

function isQueueFull(e: unknown): boolean {
  return typeof e === "object" && e !== null && (e as { code?: unknown }).code === -184;
}

/** How long one poll of the consume loop blocks waiting for an answer. */
const CONSUME_TIMEOUT_MS = 50;

/** stepgate over Kafka. `await KafkaClient.connect({ brokers })`. */
export class KafkaClient implements Transport {
  readonly intents: string;
  readonly results: string;
  /** The approvals topic in use, or null when there is none (held calls then just wait). */
  readonly approvals: string | null;
  /** Partitions of the intents topic: a workflow's answers come in the same partition number of results. */
  readonly partitions: number;

  readonly #producer: RdKafka.Producer;
  readonly #consumer: RdKafka.KafkaConsumer;
  readonly #options: Timings;
  readonly #waiting = new Map<string, Set<Waiter>>();
  readonly #following = new Map<number, Promise<void>>();
  readonly #deliveries = new Map<number, (err: unknown) => void>();
  #nextOpaque = 0;
  #closed = false;
  /** Records that were not answers (malformed), for a log or a test. */
  malformed = 0;

  private constructor(
    producer: RdKafka.Producer,
    consumer: RdKafka.KafkaConsumer,
    topics: { intents: string; results: string; approvals: string | null; partitions: number },
    options: Timings,
  ) {
    this.#producer = producer;
    this.#consumer = consumer;
    this.intents = topics.intents;
    this.results = topics.results;
    this.approvals = topics.approvals;
    this.partitions = topics.partitions;
    this.#options = options;
    producer.on("delivery-report", (err: unknown, report: RdKafka.DeliveryReport) => {
      const done = this.#deliveries.get(report?.opaque as number);
      if (done !== undefined) {
        this.#deliveries.delete(report.opaque as number);
        done(err);
      }
    });
    consumer.on("data", (msg: RdKafka.Message) => this.#receive(msg));
    consumer.consume();
  }

  /** Connects a producer and a consumer and reads the topics' layout. */
  static async connect(options: KafkaClientOptions): Promise<KafkaClient> {
    const Kafka = require("@confluentinc/kafka-javascript") as typeof RdKafka;
    const intents = options.intents ?? "stepgate.intents";
    const results = options.results ?? "stepgate.results";
    const approvalsWanted = options.approvals === undefined ? "stepgate.approvals" : options.approvals;
    const metadataTimeoutMs = options.metadataTimeoutMs ?? 10_000;
    const extra = options.config ?? {};
    const producer = new Kafka.Producer({
      "bootstrap.servers": options.brokers,
      // Exactly one copy of each publish in the log, whatever the retries.
      "enable.idempotence": true,
      "linger.ms": 0,
      // Intents go to the partition computed here (murmur2, as the gate
      // checks); the partitioner only matters to other code sharing it.
      partitioner: "murmur2_random",
      dr_cb: true,
      ...extra,
    } as RdKafka.ProducerGlobalConfig);
    const consumer = new Kafka.KafkaConsumer({
      "bootstrap.servers": options.brokers,
      "group.id": `stepgate-client-${freshCallId()}`,
      "enable.auto.commit": false,
      "isolation.level": "read_committed",
      ...extra,
    } as RdKafka.ConsumerGlobalConfig);
    const opened: Array<{ disconnect: (cb: () => void) => unknown }> = [];
    try {
      await promisify((cb) => producer.connect({ timeout: metadataTimeoutMs }, cb));
      opened.push(producer as never);
      producer.setPollInterval(20);
      await promisify((cb) => consumer.connect({ timeout: metadataTimeoutMs }, cb));
      opened.push(consumer as never);
      consumer.setDefaultConsumeTimeout(CONSUME_TIMEOUT_MS);
      // The consume loop sleeps this long after each empty poll (500 ms by
      // default): an answer arriving after a quiet moment would wait for it.
      // Each poll blocks for the timeout above, so no delay is no busy loop.
      consumer.setDefaultConsumeLoopTimeoutDelay(0);
      const count = async (topic: string): Promise<number> => {
        const md = await promisify<RdKafka.Metadata>((cb) =>
          producer.getMetadata({ topic, timeout: metadataTimeoutMs }, cb),
        ).catch(() => undefined);
        const t = md?.topics.find((x) => x.name === topic);
        return t?.partitions.length ?? 0;
      };
      const intentPartitions = await count(intents);
      const resultPartitions = await count(results);
      if (intentPartitions === 0) throw new StepgateConfigError(`topic ${intents} not found`);
      if (resultPartitions === 0) throw new StepgateConfigError(`topic ${results} not found`);
      if (resultPartitions < intentPartitions) {
        throw new StepgateConfigError(
          `${results} has ${resultPartitions} partitions, fewer than ${intents}'s ${intentPartitions}: ` +
            "stepgate answers in the intent's partition number and refuses to run on this layout",
        );
      }
      // Held calls are announced in the step's partition of approvals, when that topic exists.
      const approvals =
        approvalsWanted !== null && (await count(approvalsWanted)) >= intentPartitions ? approvalsWanted : null;
      return new KafkaClient(
        producer,
        consumer,
        { intents, results, approvals, partitions: intentPartitions },
        {
          metadataTimeoutMs,
          republishAfterMs: options.republishAfterMs ?? 10_000,
          timeoutMs: options.timeoutMs ?? 60_000,
        },
      );
    } catch (e) {
      await Promise.all(opened.map((c) => new Promise<void>((r) => c.disconnect(() => r()))));
      throw e;
    }
  }

  /** The intents partition of a workflow, which is also its answers' partition. */
  partition(workflowId: string): number {
    return partitionFor(workflowId, this.partitions);
  }

  /** A workflow numbering its calls from `nextStep` (persist `nextStep` with the run). */
  workflow(workflowId: string, nextStep = 0): Workflow {
    return new Workflow(this, workflowId, nextStep);
  }

  /** Calls waiting for their answer now. */
  inFlight(): number {
    let n = 0;
    for (const w of this.#waiting.values()) n += w.size;
    return n;
  }

  /**
   * Read answers (and approval events) of `partition` from its current end
   * on: every answer to an intent published after this is at or after it.
   * Once per partition; concurrent calls share the one request.
   */
  #follow(partition: number): Promise<void> {
    let following = this.#following.get(partition);
    if (following === undefined) {
      following = (async () => {
        const topics = [this.results, ...(this.approvals ? [this.approvals] : [])];
        const starts: RdKafka.TopicPartitionOffset[] = [];
        for (const topic of topics) {
          const deadline = Date.now() + this.#options.metadataTimeoutMs;
          for (;;) {
            try {
              const w = await promisify<RdKafka.WatermarkOffsets>((cb) =>
                this.#consumer.queryWatermarkOffsets(topic, partition, this.#options.metadataTimeoutMs, cb),
              );
              starts.push({ topic, partition, offset: w.highOffset });
              break;
            } catch (e) {
              // A new topic's leader may not be known yet: ask again.
              if (Date.now() >= deadline) throw e;
              await new Promise((r) => setTimeout(r, 100));
            }
          }
        }
        (this.#consumer as unknown as { incrementalAssign(a: RdKafka.Assignment[]): void }).incrementalAssign(starts);
      })();
      this.#following.set(partition, following);
      // A failed follow is asked again by the next call.
      following.catch(() => this.#following.delete(partition));
    }
    return following;
  }

  #receive(msg: RdKafka.Message): void {
    if (msg.value === null) return;
    let value: unknown;
    try {
      value = JSON.parse(msg.value.toString("utf8"));
    } catch {
      this.malformed++;
      return;
    }
    if (this.approvals !== null && msg.topic === this.approvals) {
      this.#heldEvent(value);
      return;
    }
    let answer: Answer;
    try {
      answer = answerFromRecord(value);
    } catch (e) {
      if (e instanceof MalformedAnswer) {
        this.malformed++;
        return;
      }
      throw e;
    }
    const key = keyOf(answer.workflowId, answer.stepIndex, answer.tool, answer.attempt, answer.callId);
    const waiters = this.#waiting.get(key);
    if (waiters === undefined) return;
    this.#waiting.delete(key);
    for (const w of waiters) w.settle(answer);
  }

  #heldEvent(event: unknown): void {
    if (typeof event !== "object" || event === null) return;
    const e = event as Record<string, unknown>;
    if (e.event !== "requested" || typeof e.call_id !== "string") return;
    const key = keyOf(String(e.workflow_id), Number(e.step_index), String(e.tool), Number(e.attempt ?? 0), e.call_id);
    for (const w of this.#waiting.get(key) ?? []) w.onHeld?.(e);
  }

  #publish(call: StepCall, value: Buffer, onError: (e: Error) => void): void {
    const opaque = this.#nextOpaque++;
    this.#deliveries.set(opaque, (err) => {
      if (err) {
        onError(
          new StepgatePublishError(
            `publishing the intent of step ${call.stepIndex} of ${call.workflowId} failed: ${String((err as Error).message ?? err)}. ` +
              "It may or may not have reached stepgate: call again with the same step key.",
            { cause: err },
          ),
        );
      }
    });
    try {
      this.#producer.produce(
        this.intents,
        this.partition(call.workflowId),
        value,
        Buffer.from(call.workflowId, "utf8"),
        null,
        opaque,
      );
    } catch (e) {
      this.#deliveries.delete(opaque);
      throw e;
    }
  }

  /**
   * Publish one call and wait for what it comes to: its `Answer` (any status,
   * `in_doubt` included), `held` (with `onHeld: "return"`), or `unanswered`
   * after `timeoutMs`. Rejects with the signal's reason when aborted, and with
   * `StepgatePublishError` when Kafka refused the intent.
   */
  async call(call: StepCall, options: CallOptions = {}): Promise<Outcome> {
    checkCall(call);
    if (this.#closed) throw new StepgateClosed("the client is closed");
    const signal = options.signal;
    signal?.throwIfAborted();
    const callId = call.callId ?? freshCallId();
    const attempt = call.attempt ?? 0;
    const timeoutMs = options.timeoutMs ?? this.#options.timeoutMs;
    const value = Buffer.from(JSON.stringify(intentRecord(call, callId)), "utf8");
    // Follow the answers' partition before the intent can be answered.
    await this.#follow(this.partition(call.workflowId));
    signal?.throwIfAborted();
    const key = keyOf(call.workflowId, call.stepIndex, call.tool, attempt, callId);
    const base = { workflowId: call.workflowId, stepIndex: call.stepIndex, tool: call.tool, attempt, callId };

    return new Promise<Outcome>((resolve, reject) => {
      const timers: ReturnType<typeof setTimeout>[] = [];
      let done = false;
      const finish = (outcome: Outcome | Error) => {
        if (done) return;
        done = true;
        for (const t of timers) clearTimeout(t);
        signal?.removeEventListener("abort", onAbort);
        const set = this.#waiting.get(key);
        set?.delete(waiter);
        if (set?.size === 0) this.#waiting.delete(key);
        if (outcome instanceof Error) reject(outcome);
        else resolve(outcome);
      };
      const onAbort = () => finish(signal?.reason instanceof Error ? signal.reason : new Error(String(signal?.reason)));
      const waiter: Waiter = {
        settle: finish,
        ...(options.onHeld === "return"
          ? { onHeld: (event: Record<string, unknown>) => finish({ kind: "held", ...base, event }) }
          : {}),
      };
      let set = this.#waiting.get(key);
      if (set === undefined) this.#waiting.set(key, (set = new Set()));
      set.add(waiter);
      signal?.addEventListener("abort", onAbort, { once: true });
      timers.push(
        setTimeout(
          () => finish({ kind: "unanswered", ...base, reason: `no answer for step ${call.stepIndex} of ${call.workflowId} (${call.tool}) in ${timeoutMs} ms` }),
          timeoutMs,
        ),
      );
      const publish = () => {
        if (done) return;
        try {
          this.#publish(call, value, finish);
        } catch (e) {
          if (isQueueFull(e)) {
            timers.push(setTimeout(publish, 20));
            return;
          }
          finish(new StepgatePublishError(`publishing the intent failed: ${(e as Error).message}`, { cause: e }));
          return;
        }
        // Silence this long: the same intent again (the same step, harmless).
        timers.push(setTimeout(publish, this.#options.republishAfterMs));
      };
      publish();
    });
  }

  /** Stop reading answers; calls still waiting reject with `StepgateClosed`. */
  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    const waiting = [...this.#waiting.values()];
    this.#waiting.clear();
    for (const set of waiting) for (const w of set) w.settle(new StepgateClosed("the client was closed while the call waited"));
    await new Promise<void>((r) => this.#producer.flush(5_000, () => r()));
    await new Promise<void>((r) => this.#producer.disconnect(() => r()));
    // kafka-javascript's disconnect drops the messages its consume loop has
    // handed to the event loop but not yet delivered, without freeing them; a
    // message never freed keeps its partition, and so its broker thread,
    // alive, and the consumer's destroy waits for that thread forever. So
    // nothing more is fetched (unassign), and the loop's last poll (it blocks
    // at most CONSUME_TIMEOUT_MS) is delivered before the disconnect.
    try {
      this.#consumer.unassign();
    } catch {
      // Not connected, or nothing assigned: nothing is in flight.
    }
    await new Promise((r) => setTimeout(r, 2 * CONSUME_TIMEOUT_MS));
    await new Promise<void>((r) => this.#consumer.disconnect(() => r()));
  }
}

/** `KafkaClient`, under the name the other clients use. */
export { KafkaClient as Client };
