// The broker's request and byte counters, read over JMX from a local Kafka
// JVM by pid (the Attach API starts its local management agent): what
// stepgate-bench reads before and after a flood to tell the broker's work per
// intent (issue #34). No broker flags needed.
//
//   javac -d DIR BrokerMetrics.java && java -cp DIR BrokerMetrics PID [PID ...]
//
// Prints `name value` lines, each summed over the pids given: request counts by
// API (`requests.Produce`, `requests.FetchConsumer`, `requests.EndTxn`, …),
// `bytes_in`, `bytes_out`, `messages_in`, `produce_requests`, `fetch_requests`,
// and `bytes_in.topic.T` / `bytes_out.topic.T` for each topic T.
import com.sun.tools.attach.VirtualMachine;
import java.util.Map;
import java.util.TreeMap;
import javax.management.MBeanServerConnection;
import javax.management.ObjectName;
import javax.management.remote.JMXConnector;
import javax.management.remote.JMXConnectorFactory;
import javax.management.remote.JMXServiceURL;

public class BrokerMetrics {
    public static void main(String[] args) throws Exception {
        Map<String, Double> sum = new TreeMap<>();
        for (String pid : args) {
            VirtualMachine vm = VirtualMachine.attach(pid);
            String address;
            try {
                address = vm.startLocalManagementAgent();
            } finally {
                vm.detach();
            }
            try (JMXConnector c = JMXConnectorFactory.connect(new JMXServiceURL(address))) {
                MBeanServerConnection s = c.getMBeanServerConnection();
                for (ObjectName n : s.queryNames(
                        new ObjectName("kafka.network:type=RequestMetrics,name=RequestsPerSec,*"), null)) {
                    add(sum, "requests." + n.getKeyProperty("request"), s.getAttribute(n, "Count"));
                }
                String[][] topic = {
                    {"BytesInPerSec", "bytes_in"}, {"BytesOutPerSec", "bytes_out"},
                    {"MessagesInPerSec", "messages_in"},
                    {"TotalProduceRequestsPerSec", "produce_requests"},
                    {"TotalFetchRequestsPerSec", "fetch_requests"},
                    {"ReplicationBytesInPerSec", "replication_bytes_in"},
                };
                for (String[] t : topic) {
                    ObjectName n = new ObjectName("kafka.server:type=BrokerTopicMetrics,name=" + t[0]);
                    if (s.isRegistered(n)) {
                        add(sum, t[1], s.getAttribute(n, "Count"));
                    }
                }
                // Bytes by topic: which reader or writer the broker's bytes go to.
                for (String[] t : new String[][] {{"BytesInPerSec", "bytes_in"}, {"BytesOutPerSec", "bytes_out"}}) {
                    for (ObjectName n : s.queryNames(
                            new ObjectName("kafka.server:type=BrokerTopicMetrics,name=" + t[0] + ",topic=*"), null)) {
                        add(sum, t[1] + ".topic." + n.getKeyProperty("topic"), s.getAttribute(n, "Count"));
                    }
                }
            }
        }
        sum.forEach((k, v) -> System.out.println(k + " " + v.longValue()));
    }

    private static void add(Map<String, Double> sum, String key, Object count) {
        sum.merge(key, ((Number) count).doubleValue(), Double::sum);
    }
}
