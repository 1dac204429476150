package stepgate.peers;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import com.fasterxml.jackson.databind.node.ObjectNode;
import java.io.IOException;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;
import java.security.NoSuchAlgorithmException;
import java.time.Duration;
import java.time.ZoneOffset;
import java.time.format.DateTimeFormatter;
import java.util.Optional;
import java.util.Properties;
import java.util.Set;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.atomic.AtomicBoolean;
import java.util.concurrent.atomic.LongAdder;
import org.apache.kafka.common.serialization.Serde;
import org.apache.kafka.common.serialization.Serdes;
import org.apache.kafka.streams.CloseOptions;
import org.apache.kafka.streams.KafkaStreams;
import org.apache.kafka.streams.StreamsBuilder;
import org.apache.kafka.streams.StreamsConfig;
import org.apache.kafka.streams.kstream.Consumed;
import org.apache.kafka.streams.kstream.Produced;
import org.apache.kafka.streams.processor.StreamPartitioner;
import org.apache.kafka.streams.processor.api.Processor;
import org.apache.kafka.streams.processor.api.ProcessorContext;
import org.apache.kafka.streams.processor.api.Record;
import org.apache.kafka.streams.processor.api.RecordMetadata;
import org.apache.kafka.streams.state.KeyValueStore;
import org.apache.kafka.streams.state.Stores;

/**
 * Benchmark peer for stepgate: the well-known Kafka Streams dedup pattern
 * (persistent RocksDB key-value store with a changelog, Processor API), keyed
 * by stepgate's step key and answering Intent v1 with Result v1. By default the
 * "tool" is a no-op executed inline, so this measures the dedup machinery only.
 * With --tool-url, the processor calls an HTTP tool for each new step the way a
 * Kafka Streams application would: a synchronous POST of the arguments, with
 * stepgate's headers (Idempotency-Key stable per step key), before the store
 * write and the answer. Its output is the answer's output.
 *
 * <p>Usage: --bootstrap H:P --input T --output T --app-id ID --state-dir DIR
 * --mode eos|alos [--threads N] [--commit-ms MS] [--tool-url URL] [--prop KEY=VALUE ...]
 *
 * <p>stdout: "READY" once RUNNING; on shutdown one JSON line of counters.
 */
public final class KStreamsDedup {
    static final String STORE = "steps";
    static final ObjectMapper JSON = new ObjectMapper();
    // Fixed millis: Instant.toString() drops ".000", DESIGN wants millis always.
    static final DateTimeFormatter TS =
            DateTimeFormatter.ofPattern("yyyy-MM-dd'T'HH:mm:ss.SSS'Z'").withZone(ZoneOffset.UTC);

    static final LongAdder PROCESSED = new LongAdder();
    static final LongAdder NEW = new LongAdder();
    static final LongAdder REPEATS = new LongAdder();
    static final LongAdder MALFORMED = new LongAdder();
    static final LongAdder TOOL_CALLS = new LongAdder();

    /** The HTTP tool of --tool-url; null: the no-op runs inline. */
    static volatile URI toolUrl;
    static final HttpClient HTTP = HttpClient.newBuilder()
            .version(HttpClient.Version.HTTP_1_1)
            .connectTimeout(Duration.ofSeconds(5))
            .build();
    static final int TOOL_TRIES = 3;

    /**
     * stepgate's Idempotency-Key for a step (src/contract: "sg1-" + hex SHA-256 of
     * workflow_id, 0, step_index as 8 bytes big-endian, tool, 0, attempt as 8 bytes).
     */
    static String idempotencyKey(String workflowId, long step, String tool, long attempt) {
        try {
            MessageDigest h = MessageDigest.getInstance("SHA-256");
            h.update(workflowId.getBytes(StandardCharsets.UTF_8));
            h.update((byte) 0);
            h.update(ByteBuffer.allocate(8).putLong(step).array());
            h.update(tool.getBytes(StandardCharsets.UTF_8));
            h.update((byte) 0);
            h.update(ByteBuffer.allocate(8).putLong(attempt).array());
            StringBuilder hex = new StringBuilder("sg1-");
            for (byte b : h.digest()) hex.append(String.format("%02x", b));
            return hex.toString();
        } catch (NoSuchAlgorithmException e) {
            throw new IllegalStateException(e); // every JVM has SHA-256
        }
    }

    /**
     * Call the tool for a new step, synchronously: the output on a 2xx, an
     * {"error": ...} node on a 4xx (a definite failure); a 5xx or an I/O error
     * is retried with the same key, then fails the task (Streams' own handling).
     */
    static JsonNode callTool(String workflowId, long step, String tool, long attempt, JsonNode args) {
        String key = idempotencyKey(workflowId, step, tool, attempt);
        String body = args == null || !args.isObject() ? "{}" : args.toString();
        HttpRequest req = HttpRequest.newBuilder(toolUrl)
                .timeout(Duration.ofSeconds(10))
                .header("Content-Type", "application/json")
                .header("Idempotency-Key", key)
                .header("Stepgate-Workflow-Id", workflowId)
                .header("Stepgate-Step-Index", Long.toString(step))
                .header("Stepgate-Attempt", Long.toString(attempt))
                .POST(HttpRequest.BodyPublishers.ofString(body))
                .build();
        String last = null;
        for (int i = 0; i < TOOL_TRIES; i++) {
            try {
                TOOL_CALLS.increment();
                HttpResponse<String> r = HTTP.send(req, HttpResponse.BodyHandlers.ofString());
                int code = r.statusCode();
                if (code >= 200 && code < 300) {
                    try {
                        return JSON.readTree(r.body().isEmpty() ? "{}" : r.body());
                    } catch (IOException e) {
                        return JSON.createObjectNode().put("body", r.body());
                    }
                }
                if (code >= 400 && code < 500) {
                    ObjectNode err = JSON.createObjectNode();
                    err.putObject("error").put("kind", "tool_failed").put("message", "HTTP " + code + ": " + r.body());
                    return err;
                }
                last = "HTTP " + code;
            } catch (IOException e) {
                last = e.toString();
            } catch (InterruptedException e) {
                Thread.currentThread().interrupt();
                throw new IllegalStateException("interrupted calling the tool", e);
            }
            try {
                Thread.sleep(100L << i);
            } catch (InterruptedException e) {
                Thread.currentThread().interrupt();
                throw new IllegalStateException("interrupted calling the tool", e);
            }
        }
        throw new IllegalStateException("tool " + toolUrl + " failed " + TOOL_TRIES + " times: " + last);
    }

    /** A result plus the partition of the intent it answers (for the sink's partitioner). */
    record Out(int partition, String json) {}

    static final class DedupProcessor implements Processor<String, String, String, Out> {
        private ProcessorContext<String, Out> ctx;
        private KeyValueStore<String, String> store;

        @Override
        public void init(ProcessorContext<String, Out> ctx) {
            this.ctx = ctx;
            this.store = ctx.getStateStore(STORE);
        }

        @Override
        public void process(Record<String, String> rec) {
            PROCESSED.increment();
            JsonNode in;
            try {
                in = rec.value() == null ? null : JSON.readTree(rec.value());
            } catch (Exception e) {
                in = null;
            }
            // Only the step-key fields are checked: the peer has no DLQ or
            // `rejected` answers, anything it cannot key is counted and skipped.
            JsonNode wf = in == null ? null : in.get("workflow_id");
            JsonNode step = in == null ? null : in.get("step_index");
            JsonNode tool = in == null ? null : in.get("tool");
            JsonNode att = in == null ? null : in.get("attempt");
            if (in == null || !in.isObject()
                    || wf == null || !wf.isTextual() || wf.asText().isEmpty()
                    || !nonNegLong(step)
                    || tool == null || !tool.isTextual() || tool.asText().isEmpty()
                    || (att != null && !att.isNull() && !nonNegLong(att))) {
                MALFORMED.increment();
                return;
            }
            String workflowId = wf.asText();
            long attempt = att == null || att.isNull() ? 0 : att.asLong();
            JsonNode callIdNode = in.get("call_id");
            String callId = callIdNode != null && callIdNode.isTextual() ? callIdNode.asText() : null;

            String key;
            String out;
            try {
                // A JSON array is an unambiguous encoding of the tuple (no
                // separator can collide with a workflow_id's characters).
                key = JSON.writeValueAsString(new Object[] {workflowId, step.asLong(), tool.asText(), attempt});
                String stored = store.get(key);
                if (stored == null) {
                    ObjectNode r = JSON.createObjectNode();
                    r.put("workflow_id", workflowId);
                    r.put("step_index", step.asLong());
                    r.put("tool", tool.asText());
                    r.put("attempt", attempt);
                    r.put("call_id", callId);
                    if (toolUrl == null) {
                        r.put("status", "ok");
                        r.putObject("output");
                    } else {
                        JsonNode got = callTool(workflowId, step.asLong(), tool.asText(), attempt, in.get("arguments"));
                        if (got.isObject() && got.size() == 1 && got.has("error")) {
                            r.put("status", "error");
                            r.set("error", got.get("error"));
                        } else {
                            r.put("status", "ok");
                            r.set("output", got);
                        }
                    }
                    r.put("deduplicated", false);
                    r.put("completed_at", TS.format(java.time.Instant.now()));
                    out = JSON.writeValueAsString(r);
                    store.put(key, out);
                    NEW.increment();
                } else {
                    // Identical to the first answer but for call_id and deduplicated;
                    // arguments are never compared (a rephrased retry is the same step).
                    ObjectNode r = (ObjectNode) JSON.readTree(stored);
                    r.put("call_id", callId);
                    r.put("deduplicated", true);
                    out = JSON.writeValueAsString(r);
                    REPEATS.increment();
                }
            } catch (com.fasterxml.jackson.core.JsonProcessingException e) {
                throw new IllegalStateException(e); // our own JSON: cannot happen
            }
            int partition = ctx.recordMetadata().map(RecordMetadata::partition).orElse(-1);
            // Input headers (e.g. traceparent) travel with the record.
            ctx.forward(rec.withKey(workflowId).withValue(new Out(partition, out)));
        }

        private static boolean nonNegLong(JsonNode n) {
            return n != null && n.isIntegralNumber() && n.canConvertToLong() && n.asLong() >= 0;
        }
    }

    /**
     * DESIGN: a result goes to the same partition number as its intent. The
     * default murmur2 partitioner would only agree with the agent's producer
     * by luck (librdkafka's default is CRC32-based), so pin it explicitly.
     */
    static final class SamePartition implements StreamPartitioner<String, Out> {
        @Override
        public Optional<Set<Integer>> partitions(String topic, String key, Out value, int numPartitions) {
            int p = value.partition();
            return p >= 0 && p < numPartitions ? Optional.of(Set.of(p)) : Optional.empty();
        }
    }

    static final Serde<Out> OUT_SERDE = Serdes.serdeFrom(
            (topic, o) -> o == null ? null : o.json().getBytes(StandardCharsets.UTF_8),
            (topic, b) -> { throw new UnsupportedOperationException("write-only serde"); });

    public static void main(String[] args) throws Exception {
        Properties p = new Properties();
        String input = null, output = null, mode = null;
        for (int i = 0; i < args.length; i++) {
            String a = args[i];
            if (i + 1 >= args.length) usage("missing value for " + a);
            String v = args[++i];
            switch (a) {
                case "--bootstrap" -> p.put(StreamsConfig.BOOTSTRAP_SERVERS_CONFIG, v);
                case "--input" -> input = v;
                case "--output" -> output = v;
                case "--app-id" -> p.put(StreamsConfig.APPLICATION_ID_CONFIG, v);
                case "--state-dir" -> p.put(StreamsConfig.STATE_DIR_CONFIG, v);
                case "--mode" -> mode = v;
                case "--threads" -> p.put(StreamsConfig.NUM_STREAM_THREADS_CONFIG, Integer.parseInt(v));
                case "--commit-ms" -> p.put(StreamsConfig.COMMIT_INTERVAL_MS_CONFIG, Long.parseLong(v));
                case "--tool-url" -> toolUrl = URI.create(v);
                case "--prop" -> { // escape hatch: any Streams/client property
                    int eq = v.indexOf('=');
                    if (eq <= 0) usage("--prop wants KEY=VALUE");
                    p.put(v.substring(0, eq), v.substring(eq + 1));
                }
                default -> usage("unknown argument " + a);
            }
        }
        if (input == null || output == null || mode == null
                || !p.containsKey(StreamsConfig.BOOTSTRAP_SERVERS_CONFIG)
                || !p.containsKey(StreamsConfig.APPLICATION_ID_CONFIG)
                || !p.containsKey(StreamsConfig.STATE_DIR_CONFIG)) usage("missing a required argument");
        switch (mode) {
            case "eos" -> p.put(StreamsConfig.PROCESSING_GUARANTEE_CONFIG, StreamsConfig.EXACTLY_ONCE_V2);
            case "alos" -> p.put(StreamsConfig.PROCESSING_GUARANTEE_CONFIG, StreamsConfig.AT_LEAST_ONCE);
            default -> usage("--mode must be eos or alos");
        }
        p.putIfAbsent(StreamsConfig.REPLICATION_FACTOR_CONFIG, 1); // single broker
        // No global stores here; set only to silence a per-start deprecation WARN.
        p.putIfAbsent(StreamsConfig.PROCESSING_EXCEPTION_HANDLER_GLOBAL_ENABLED_CONFIG, true);

        StreamsBuilder b = new StreamsBuilder();
        // Default persistent store: RocksDB, changelog logging on, no caching.
        b.addStateStore(Stores.keyValueStoreBuilder(
                Stores.persistentKeyValueStore(STORE), Serdes.String(), Serdes.String()));
        b.stream(input, Consumed.with(Serdes.String(), Serdes.String()))
                .process(DedupProcessor::new, STORE)
                .to(output, Produced.with(Serdes.String(), OUT_SERDE).withStreamPartitioner(new SamePartition()));

        KafkaStreams streams = new KafkaStreams(b.build(), p);
        CountDownLatch stopped = new CountDownLatch(1);
        AtomicBoolean ready = new AtomicBoolean();
        streams.setStateListener((now, before) -> {
            // RUNNING recurs after every rebalance; the harness wants one line.
            if (now == KafkaStreams.State.RUNNING && ready.compareAndSet(false, true)) {
                System.out.println("READY");
                System.out.flush();
            }
            if (now == KafkaStreams.State.ERROR) stopped.countDown();
        });

        AtomicBoolean closed = new AtomicBoolean();
        Runnable shutdown = () -> {
            if (!closed.compareAndSet(false, true)) return;
            // Streams' default close stays in the group (good for rolling
            // bounces) so a restart would wait session.timeout.ms (45 s) for
            // the old member; SIGTERM here means "this instance is gone".
            streams.close(CloseOptions.timeout(Duration.ofSeconds(30))
                    .withGroupMembershipOperation(CloseOptions.GroupMembershipOperation.LEAVE_GROUP));
            System.out.printf("{\"processed\": %d, \"new\": %d, \"repeats\": %d, \"malformed\": %d, \"tool_calls\": %d}%n",
                    PROCESSED.sum(), NEW.sum(), REPEATS.sum(), MALFORMED.sum(), TOOL_CALLS.sum());
            System.out.flush();
        };
        Runtime.getRuntime().addShutdownHook(new Thread(shutdown, "shutdown"));

        streams.start();
        stopped.await(); // only ERROR wakes us; SIGTERM ends the JVM through the hook
        System.err.println("kstreams-dedup: Kafka Streams entered ERROR state (see log above)");
        shutdown.run();
        System.exit(1);
    }

    static void usage(String why) {
        System.err.println("kstreams-dedup: " + why + "\nusage: --bootstrap H:P --input T --output T --app-id ID"
                + " --state-dir DIR --mode eos|alos [--threads N] [--commit-ms MS] [--tool-url URL]"
                + " [--prop KEY=VALUE]...");
        System.exit(2);
    }
}
