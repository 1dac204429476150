//! Bulk loading: a partition restored over a wiped state goes into RocksDB as
//! sorted files it ingests, not through its memtables.
//!
//! A changelog holds a partition's keys in no order. Written through
//! memtables, every flush makes a file spanning the whole partition, and
//! every L0 compaction rewrites the level below: a restore spent most of its
//! time in RocksDB. Here the records are sorted once — in memory, in runs
//! spilled to disk past a budget — and merged, the last record of each key
//! winning, into SST files that land at the bottom level untouched (the
//! partition's key range holds nothing else: every key starts with the
//! partition). The derived indexes are built from the merged records, one
//! entry per step.
//!
//! Nothing of a bulk load is visible before it is ingested, and a partition
//! is marked restored only after (`Follower::finish`): a crash leaves a
//! partition that is restored again from the start.

use super::{
    Cf, Indexed, StateError, StateStore, attention_of, deadline_of, encode_deadline, expiry_key,
};
use rocksdb::{IngestExternalFileOptions, Options, SstFileWriter};
use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes a reader's bulk loads hold in memory before the largest spills a run
/// to disk.
pub(super) const BUDGET: usize = 64 << 20;

/// An ingested file is cut past this size, as a compaction cuts its output.
const FILE_BYTES: u64 = 64 << 20;

/// The directory of a store's bulk loads (emptied at open).
pub(super) fn dir_of(db_path: &Path) -> PathBuf {
    db_path.join("bulk")
}

/// Names every file of a bulk load (several restores may run at once).
static NEXT_FILE: AtomicU64 = AtomicU64::new(0);

fn file_name(dir: &Path, partition: i32, what: &str) -> PathBuf {
    let n = NEXT_FILE.fetch_add(1, Ordering::Relaxed);
    dir.join(format!("{partition}-{n}.{what}"))
}

/// A partition's changelog records, gathered for [`StateStore::ingest`].
pub struct BulkLoad {
    records: Runs,
}

impl BulkLoad {
    pub(super) fn new(dir: PathBuf, partition: i32) -> BulkLoad {
        BulkLoad {
            records: Runs::new(dir, partition),
        }
    }

    /// A changelog record (its key as on the changelog: the column family's
    /// tag, then the state key); a later one of the same key wins.
    pub(super) fn push(&mut self, key: &[u8], value: Option<&[u8]>) {
        self.records.push(key, value);
    }

    /// Bytes held in memory.
    pub fn bytes(&self) -> usize {
        self.records.bytes()
    }

    /// Move what is held in memory to a run on disk.
    pub fn spill(&mut self) -> Result<(), StateError> {
        Ok(self.records.spill()?)
    }
}

impl StateStore {
    /// A bulk load of `partition`, which must be wiped ([`StateStore::ingest`]).
    pub fn bulk_load(&self, partition: i32) -> BulkLoad {
        BulkLoad::new(self.bulk_dir.clone(), partition)
    }

    /// Write what `load` gathered, with its indexes, as sorted files and
    /// ingest them. The partition must hold nothing: its records and index
    /// entries are taken as the whole of it (a deleted key is left out).
    pub fn ingest(&self, load: BulkLoad) -> Result<(), StateError> {
        let records = load.records;
        let partition = records.partition;
        let started = std::time::Instant::now();
        let runs = records.spilled.len();
        let dir = self.bulk_dir.clone();
        // By `Cf::index`.
        let mut files: Vec<SstFiles<'_>> = self
            .cf_opts
            .iter()
            .map(|opts| SstFiles::new(opts, &dir, partition))
            .collect();
        let mut expiry = Runs::new(dir.clone(), partition);
        records.drain::<StateError>(|key, value| {
            let Some(value) = value else {
                return Ok(());
            };
            let Some((cf, key)) = key
                .split_first()
                .and_then(|(tag, key)| Some((Cf::from_tag(*tag)?, key)))
            else {
                return Ok(());
            };
            files[cf.index()].put(key, value)?;
            if cf != Cf::Steps {
                return Ok(());
            }
            match Indexed::decode(value) {
                Ok(r) => {
                    // Steps come in key order, and so do these two indexes.
                    if let Some(d) = deadline_of(r.phase, r.deadline_ms) {
                        files[Cf::Deadlines.index()].put(key, &encode_deadline(d))?;
                    }
                    if let Some(a) = attention_of(r.phase) {
                        files[Cf::Attention.index()].put(key, &[a])?;
                    }
                    expiry.push(&expiry_key(key, r.expires_at_ms), Some(&[]));
                    if expiry.bytes() > BUDGET {
                        expiry.spill()?;
                    }
                }
                // Kept as it is, unindexed, as a restore through the
                // memtables does (`StateStore::stage`).
                Err(e) => tracing::error!(
                    error = %e,
                    "a step record on the changelog cannot be read; restored without its indexes"
                ),
            }
            Ok(())
        })?;
        expiry.drain::<StateError>(|key, _| files[Cf::Expiry.index()].put(key, &[]))?;
        let mut ingest = IngestExternalFileOptions::default();
        ingest.set_move_files(true);
        for (cf, f) in Cf::ALL.into_iter().zip(files) {
            let paths = f.finish()?;
            if !paths.is_empty() {
                self.db
                    .ingest_external_file_cf_opts(self.cf(cf), &ingest, paths)?;
            }
        }
        tracing::debug!(
            partition,
            runs,
            ms = started.elapsed().as_millis() as u64,
            "bulk load ingested"
        );
        Ok(())
    }
}

/// Sorted SST files of one column family, cut at [`FILE_BYTES`].
struct SstFiles<'o> {
    opts: &'o Options,
    dir: &'o Path,
    partition: i32,
    open: Option<SstFileWriter<'o>>,
    done: Vec<PathBuf>,
}

impl<'o> SstFiles<'o> {
    fn new(opts: &'o Options, dir: &'o Path, partition: i32) -> SstFiles<'o> {
        SstFiles {
            opts,
            dir,
            partition,
            open: None,
            done: Vec::new(),
        }
    }

    /// Keys must come in order.
    fn put(&mut self, key: &[u8], value: &[u8]) -> Result<(), StateError> {
        let w = match &mut self.open {
            Some(w) => w,
            None => {
                let path = file_name(self.dir, self.partition, "sst");
                let w = SstFileWriter::create(self.opts);
                w.open(&path)?;
                self.done.push(path);
                self.open.insert(w)
            }
        };
        w.put(key, value)?;
        if w.file_size() >= FILE_BYTES {
            self.close()?;
        }
        Ok(())
    }

    fn close(&mut self) -> Result<(), StateError> {
        if let Some(mut w) = self.open.take() {
            w.finish()?;
        }
        Ok(())
    }

    /// The files written, in key order.
    fn finish(mut self) -> Result<Vec<PathBuf>, StateError> {
        self.close()?;
        Ok(std::mem::take(&mut self.done))
    }
}

impl Drop for SstFiles<'_> {
    /// Files of a load that failed (ingested ones have moved).
    fn drop(&mut self) {
        for p in &self.done {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Records sorted by key in runs: in memory up to what the caller allows,
/// then spilled to files that [`Runs::drain`] merges.
struct Runs {
    dir: PathBuf,
    partition: i32,
    arena: Vec<u8>,
    entries: Vec<Entry>,
    spilled: Vec<PathBuf>,
}

/// A record in a run's arena: its key, then its value.
#[derive(Clone, Copy)]
struct Entry {
    at: usize,
    key: u32,
    /// The value's length, or [`DELETED`].
    value: u32,
}

const DELETED: u32 = u32::MAX;

impl Runs {
    fn new(dir: PathBuf, partition: i32) -> Runs {
        Runs {
            dir,
            partition,
            arena: Vec::new(),
            entries: Vec::new(),
            spilled: Vec::new(),
        }
    }

    fn push(&mut self, key: &[u8], value: Option<&[u8]>) {
        let at = self.arena.len();
        self.arena.extend_from_slice(key);
        if let Some(v) = value {
            self.arena.extend_from_slice(v);
        }
        self.entries.push(Entry {
            at,
            key: key.len() as u32,
            value: value.map_or(DELETED, |v| v.len() as u32),
        });
    }

    fn bytes(&self) -> usize {
        self.arena.len() + self.entries.len() * std::mem::size_of::<Entry>()
    }

    fn key(&self, e: &Entry) -> &[u8] {
        &self.arena[e.at..e.at + e.key as usize]
    }

    fn value(&self, e: &Entry) -> Option<&[u8]> {
        let at = e.at + e.key as usize;
        (e.value != DELETED).then(|| &self.arena[at..at + e.value as usize])
    }

    /// The entries in key order, only the last pushed of each key.
    fn sorted(&mut self) -> Vec<Entry> {
        let mut entries = std::mem::take(&mut self.entries);
        // Stable: equal keys keep the order they came in.
        entries.sort_by(|a, b| self.key(a).cmp(self.key(b)));
        let mut out: Vec<Entry> = Vec::with_capacity(entries.len());
        for e in entries {
            match out.last_mut() {
                Some(last) if self.key(last) == self.key(&e) => *last = e,
                _ => out.push(e),
            }
        }
        out
    }

    /// Sort what memory holds and write it to a run.
    fn spill(&mut self) -> io::Result<()> {
        if self.entries.is_empty() {
            return Ok(());
        }
        let path = file_name(&self.dir, self.partition, "run");
        self.spilled.push(path.clone());
        let mut w = RunWriter::create(&path)?;
        for e in self.sorted() {
            w.record(self.key(&e), self.value(&e))?;
        }
        w.finish()?;
        self.arena.clear();
        Ok(())
    }

    /// Every key once, in order, with its last value (None: deleted).
    fn drain<E: From<io::Error>>(
        mut self,
        mut f: impl FnMut(&[u8], Option<&[u8]>) -> Result<(), E>,
    ) -> Result<(), E> {
        if self.spilled.is_empty() {
            for e in self.sorted() {
                f(self.key(&e), self.value(&e))?;
            }
            return Ok(());
        }
        self.spill()?;
        self.arena = Vec::new();
        // At most MERGE_WIDTH runs are merged at once (each an open file):
        // past it the oldest are merged into one run, which stays the oldest.
        while self.spilled.len() > MERGE_WIDTH {
            let path = file_name(&self.dir, self.partition, "run");
            self.spilled.insert(0, path.clone());
            let mut w = RunWriter::create(&path)?;
            merge(&self.spilled[1..=MERGE_WIDTH], |k, v| w.record(k, v))?;
            w.finish()?;
            for p in self.spilled.drain(1..=MERGE_WIDTH) {
                let _ = std::fs::remove_file(p);
            }
        }
        merge(&self.spilled, f)
    }
}

/// Most runs merged at once.
const MERGE_WIDTH: usize = 64;

/// Every key of the runs at `paths` (oldest first) once, in order, with its
/// value in the newest run that has it (None: deleted).
fn merge<E: From<io::Error>>(
    paths: &[PathBuf],
    mut f: impl FnMut(&[u8], Option<&[u8]>) -> Result<(), E>,
) -> Result<(), E> {
    let mut runs = paths
        .iter()
        .map(|p| RunReader::open(p))
        .collect::<io::Result<Vec<_>>>()?;
    // The least key on top; of equal keys the oldest run first, so the last
    // one taken is the newest: its value wins.
    let mut heap = std::collections::BinaryHeap::new();
    for (i, r) in runs.iter_mut().enumerate() {
        if let Some(k) = r.next()? {
            heap.push(std::cmp::Reverse((k, i)));
        }
    }
    let mut behind = Vec::new();
    while let Some(std::cmp::Reverse((key, mut newest))) = heap.pop() {
        while heap
            .peek()
            .is_some_and(|std::cmp::Reverse((k, _))| *k == key)
        {
            let Some(std::cmp::Reverse((_, i))) = heap.pop() else {
                break;
            };
            behind.push(newest);
            newest = i;
        }
        f(&key, runs[newest].value())?;
        for i in behind.drain(..).chain([newest]) {
            if let Some(k) = runs[i].next()? {
                heap.push(std::cmp::Reverse((k, i)));
            }
        }
    }
    Ok(())
}

impl Drop for Runs {
    fn drop(&mut self) {
        for p in &self.spilled {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// A run's records are written in LZ4 blocks of at least this many bytes
/// (a record is never split): a restore's runs hold the partition's whole
/// changelog, and compressed they take a few times less disk.
const BLOCK: usize = 256 << 10;

/// Writes a sorted run: blocks of `raw length, compressed length (u32 LE),
/// LZ4 block`, each holding whole records of `key length (u32 LE), key,
/// value length (u32 LE, or DELETED), value`.
struct RunWriter {
    file: BufWriter<File>,
    raw: Vec<u8>,
    packed: Vec<u8>,
}

impl RunWriter {
    fn create(path: &Path) -> io::Result<RunWriter> {
        Ok(RunWriter {
            file: BufWriter::new(File::create(path)?),
            raw: Vec::with_capacity(2 * BLOCK),
            packed: Vec::new(),
        })
    }

    fn record(&mut self, key: &[u8], value: Option<&[u8]>) -> io::Result<()> {
        let value_len = value.map_or(DELETED, |v| v.len() as u32);
        self.raw
            .extend_from_slice(&(key.len() as u32).to_le_bytes());
        self.raw.extend_from_slice(key);
        self.raw.extend_from_slice(&value_len.to_le_bytes());
        self.raw.extend_from_slice(value.unwrap_or_default());
        if self.raw.len() >= BLOCK {
            self.block()?;
        }
        Ok(())
    }

    fn block(&mut self) -> io::Result<()> {
        if self.raw.is_empty() {
            return Ok(());
        }
        lz4::compress(&self.raw, &mut self.packed)?;
        self.file
            .write_all(&(self.raw.len() as u32).to_le_bytes())?;
        self.file
            .write_all(&(self.packed.len() as u32).to_le_bytes())?;
        self.file.write_all(&self.packed)?;
        self.raw.clear();
        Ok(())
    }

    fn finish(mut self) -> io::Result<()> {
        self.block()?;
        self.file.flush()
    }
}

/// Reads a spilled run back, a record at a time.
struct RunReader {
    file: BufReader<File>,
    packed: Vec<u8>,
    block: Vec<u8>,
    at: usize,
    /// Where the current record's value lies in `block` (None: deleted).
    value: Option<(usize, usize)>,
}

impl RunReader {
    fn open(path: &Path) -> io::Result<RunReader> {
        Ok(RunReader {
            file: BufReader::with_capacity(64 << 10, File::open(path)?),
            packed: Vec::new(),
            block: Vec::new(),
            at: 0,
            value: None,
        })
    }

    /// The next record's key (its value is then [`RunReader::value`]).
    fn next(&mut self) -> io::Result<Option<Vec<u8>>> {
        if self.at == self.block.len() && !self.next_block()? {
            return Ok(None);
        }
        let corrupt = || io::Error::new(io::ErrorKind::InvalidData, "a spilled run is corrupt");
        let mut take = |n: usize| -> io::Result<(usize, usize)> {
            let from = self.at;
            self.at = from
                .checked_add(n)
                .filter(|&end| end <= self.block.len())
                .ok_or_else(corrupt)?;
            Ok((from, self.at))
        };
        let len = |b: &[u8], (from, to): (usize, usize)| {
            u32::from_le_bytes(b[from..to].try_into().expect("four bytes"))
        };
        let k = take(4)?;
        let k = take(len(&self.block, k) as usize)?;
        let v = take(4)?;
        self.value = match len(&self.block, v) {
            DELETED => None,
            n => Some(take(n as usize)?),
        };
        Ok(Some(self.block[k.0..k.1].to_vec()))
    }

    /// Read the next block; false at the run's end.
    fn next_block(&mut self) -> io::Result<bool> {
        let mut head = [0u8; 8];
        match self.file.read_exact(&mut head) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(false),
            Err(e) => return Err(e),
        }
        let raw = u32::from_le_bytes(head[..4].try_into().expect("four bytes")) as usize;
        let packed = u32::from_le_bytes(head[4..].try_into().expect("four bytes")) as usize;
        self.packed.resize(packed, 0);
        self.file.read_exact(&mut self.packed)?;
        lz4::decompress(&self.packed, raw, &mut self.block)?;
        self.at = 0;
        Ok(true)
    }

    fn value(&self) -> Option<&[u8]> {
        self.value.map(|(from, to)| &self.block[from..to])
    }
}

/// LZ4's block format, through the library RocksDB links.
mod lz4 {
    use std::io;
    use std::os::raw::{c_char, c_int};

    fn too_large() -> io::Error {
        io::Error::other("an LZ4 block over 2 GiB")
    }

    /// `raw` compressed into `out` (replacing what it held).
    pub(super) fn compress(raw: &[u8], out: &mut Vec<u8>) -> io::Result<()> {
        let len = c_int::try_from(raw.len()).map_err(|_| too_large())?;
        // SAFETY: a pure function of its argument.
        let bound = unsafe { lz4_sys::LZ4_compressBound(len) };
        out.clear();
        out.reserve(usize::try_from(bound).map_err(|_| too_large())?);
        // SAFETY: `raw` is `len` readable bytes; `out` has `bound` writable
        // bytes, at most what LZ4 writes.
        let n = unsafe {
            lz4_sys::LZ4_compress_default(
                raw.as_ptr().cast::<c_char>(),
                out.as_mut_ptr().cast::<c_char>(),
                len,
                bound,
            )
        };
        let n = usize::try_from(n)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| io::Error::other("LZ4 compression failed"))?;
        // SAFETY: LZ4 wrote `n` bytes.
        unsafe { out.set_len(n) };
        Ok(())
    }

    /// `packed`, which holds `raw` bytes, decompressed into `out`.
    pub(super) fn decompress(packed: &[u8], raw: usize, out: &mut Vec<u8>) -> io::Result<()> {
        let (len, cap) = (
            c_int::try_from(packed.len()).map_err(|_| too_large())?,
            c_int::try_from(raw).map_err(|_| too_large())?,
        );
        out.clear();
        out.reserve(raw);
        // SAFETY: `packed` is `len` readable bytes; `out` has `raw` writable
        // bytes, and LZ4's safe decoder never writes past `cap`.
        let n = unsafe {
            lz4_sys::LZ4_decompress_safe(
                packed.as_ptr().cast::<c_char>(),
                out.as_mut_ptr().cast::<c_char>(),
                len,
                cap,
            )
        };
        if usize::try_from(n).ok() != Some(raw) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "a spilled run is corrupt",
            ));
        }
        // SAFETY: LZ4 wrote `raw` bytes.
        unsafe { out.set_len(raw) };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drained(r: Runs) -> Vec<(Vec<u8>, Option<Vec<u8>>)> {
        let mut out = Vec::new();
        r.drain::<io::Error>(|k, v| {
            out.push((k.to_vec(), v.map(<[u8]>::to_vec)));
            Ok(())
        })
        .expect("drain");
        out
    }

    /// In memory and across spilled runs alike: every key once, in order,
    /// the last record pushed winning (a deletion included).
    #[test]
    fn runs_keep_the_last_record_of_each_key() {
        let dir = tempfile::tempdir().expect("dir");
        let mut model = std::collections::BTreeMap::new();
        let mut pushes = Vec::new();
        let mut x: u64 = 7;
        for i in 0..5000u32 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let key = format!("k{:03}", (x >> 33) % 700).into_bytes();
            let value = (!x.is_multiple_of(5)).then(|| i.to_be_bytes().to_vec());
            model.insert(key.clone(), value.clone());
            pushes.push((key, value));
        }
        let want: Vec<_> = model.into_iter().collect();
        // 50: more runs than are merged at once.
        for spill_every in [0, 50, 333, 1000] {
            let mut r = Runs::new(dir.path().to_owned(), 3);
            for (i, (k, v)) in pushes.iter().enumerate() {
                r.push(k, v.as_deref());
                if spill_every > 0 && i % spill_every == spill_every - 1 {
                    r.spill().expect("spill");
                }
            }
            assert_eq!(drained(r), want, "spilling every {spill_every}");
        }
        assert_eq!(
            std::fs::read_dir(dir.path()).expect("dir").count(),
            0,
            "runs are removed once drained"
        );
    }
}
