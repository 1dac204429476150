/** Kafka's murmur2 partitioner, as its Java clients (and stepgate's gate) compute it. */

/** Kafka's murmur2 of `data`, as an unsigned 32-bit integer. */
export function murmur2(data: Uint8Array): number {
  const m = 0x5bd1e995;
  const r = 24;
  let h = (0x9747b28c ^ data.length) >>> 0;
  const n = data.length >>> 2;
  for (let i = 0; i < n; i++) {
    const o = i * 4;
    let k = (data[o]! | (data[o + 1]! << 8) | (data[o + 2]! << 16) | (data[o + 3]! << 24)) >>> 0;
    k = Math.imul(k, m) >>> 0;
    k = (k ^ (k >>> r)) >>> 0;
    k = Math.imul(k, m) >>> 0;
    h = Math.imul(h, m) >>> 0;
    h = (h ^ k) >>> 0;
  }
  const tail = n * 4;
  switch (data.length & 3) {
    case 3:
      h = (h ^ (data[tail + 2]! << 16)) >>> 0;
    // falls through
    case 2:
      h = (h ^ (data[tail + 1]! << 8)) >>> 0;
    // falls through
    case 1:
      h = (h ^ data[tail]!) >>> 0;
      h = Math.imul(h, m) >>> 0;
  }
  h = (h ^ (h >>> 13)) >>> 0;
  h = Math.imul(h, m) >>> 0;
  h = (h ^ (h >>> 15)) >>> 0;
  return h;
}

const utf8 = new TextEncoder();

/** The partition that owns a workflow: murmur2 of its UTF-8 id, sign bit cleared, modulo `partitions`. */
export function partitionFor(workflowId: string, partitions: number): number {
  if (!(partitions > 0)) return 0;
  return (murmur2(utf8.encode(workflowId)) & 0x7fffffff) % partitions;
}
