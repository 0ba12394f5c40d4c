//! The coordinator's embedded store (redb, one file in the state dir): job
//! records and the per-step records (metrics + manifest of documents).
//! Every write is one committed, durable transaction, so a coordinator
//! killed at any point restarts with a consistent view.
//!
//! Bounded state (issue 19): only a job's newest step records stay in redb
//! (fewer than 2 × [`HOT_STEPS`]). Older ones move, in batches, to cold
//! files written once and never changed
//! (`state_dir/cold/<hex job id>/<first>-<last>.steps`, the same compact
//! records), so the database stops growing with the number of steps. Every
//! reader goes through [`Store::steps`], which reads both: replay after a
//! restart (the steps after the oldest retained checkpoint, however old),
//! `accrue steps` and its exactly-once check, the metrics API and watch
//! history see every step as before. Bisecting works on the in-memory
//! history, never the store.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use redb::{Database, ReadableTable, TableDefinition};

mod error;
mod records;

pub use error::{Result, StoreError};
pub use records::StepRecord;

use crate::core::{CommittedStep, JobRecord, RefEntry, ReferenceLogps, StepMetrics};
use crate::stream::doc::DocId;
use error::{decode, json};
use records::{compact, read_cold, step_record, write_cold};

const JOBS: TableDefinition<&str, &[u8]> = TableDefinition::new("jobs");
/// Key: (job id, step).
const STEPS: TableDefinition<(&str, u64), &[u8]> = TableDefinition::new("steps");
/// Key: (job id, file, line) → DPO reference log-probs `[chosen, rejected]`.
const REFERENCE: TableDefinition<(&str, u32, u64), (f64, f64)> = TableDefinition::new("reference");
/// Key: (job id, file, line) → a rollout's per-token reference log-probs
/// (little-endian f32, one per token).
const REFERENCE_TOKENS: TableDefinition<(&str, u32, u64), &[u8]> =
    TableDefinition::new("reference_tokens");
/// Key: (job id, admission line) → a streamed job's queued rollout (JSON).
const ROLLOUTS: TableDefinition<(&str, u64), &[u8]> = TableDefinition::new("rollouts");
/// Key: job id → its stream's `StreamMeta` (JSON).
const STREAMS: TableDefinition<&str, &[u8]> = TableDefinition::new("streams");
/// Facts about the coordinator itself; key [`COORDINATOR_ID`].
const META: TableDefinition<&str, &str> = TableDefinition::new("meta");
/// The key of the coordinator's id in [`META`].
const COORDINATOR_ID: &str = "coordinator_id";

/// Step records a job keeps in redb at least; at twice as many, all but
/// the newest this many move to a cold file.
pub const HOT_STEPS: u64 = 64;

/// redb's page cache: a bound on the store's resident memory.
const CACHE_BYTES: usize = 64 << 20;

/// A handle to the state store (clones share the database).
#[derive(Clone)]
pub struct Store {
    db: Arc<Database>,
    /// `state_dir/cold`: step records moved out of redb.
    cold: PathBuf,
    /// Set while a [`Cooling`] runs: one at a time, so two never move the
    /// same records.
    cooling: Arc<AtomicBool>,
    /// Tests: every write fails while set (a full or failing disk).
    #[cfg(test)]
    failing: Arc<AtomicBool>,
}

/// Moving one job's old step records to a cold file, taken from the store
/// ([`Store::cooling`]) to run where no lock is held: it reads, writes and
/// syncs a file of [`HOT_STEPS`] records. Readers see every record
/// throughout (see [`Store::steps`]).
pub struct Cooling {
    db: Arc<Database>,
    dir: PathBuf,
    job: String,
    /// The records it moves: steps `first..=last`.
    first: u64,
    last: u64,
    busy: Arc<AtomicBool>,
}

impl Drop for Cooling {
    fn drop(&mut self) {
        self.busy.store(false, Ordering::Release);
    }
}

impl Store {
    /// Opens (or creates) `state_dir/accrue.redb`.
    pub fn open(state_dir: &Path) -> Result<Store> {
        let path = state_dir.join("accrue.redb");
        // redb caches up to 1 GiB by default, and every page a commit
        // writes stays there: ~1 MiB of resident memory per step at
        // W = 1024. The OS page cache serves rereads anyway.
        let db = Database::builder()
            .set_cache_size(CACHE_BYTES)
            .create(&path)
            .map_err(|source| StoreError::Open {
                path: path.display().to_string(),
                source,
            })?;
        let tx = db.begin_write()?;
        tx.open_table(JOBS)?;
        tx.open_table(STEPS)?;
        tx.open_table(REFERENCE)?;
        tx.open_table(REFERENCE_TOKENS)?;
        tx.open_table(ROLLOUTS)?;
        tx.open_table(STREAMS)?;
        tx.open_table(META)?;
        tx.commit()?;
        Ok(Store {
            db: Arc::new(db),
            cold: state_dir.join("cold"),
            cooling: Arc::new(AtomicBool::new(false)),
            #[cfg(test)]
            failing: Arc::new(AtomicBool::new(false)),
        })
    }

    /// Tests: makes every write fail (`on`) or succeed again.
    #[cfg(test)]
    pub(crate) fn fail_writes(&self, on: bool) {
        self.failing.store(on, Ordering::SeqCst);
    }

    /// A write's transaction (tests may make it fail).
    fn begin_write(&self) -> Result<redb::WriteTransaction> {
        #[cfg(test)]
        if self.failing.load(Ordering::SeqCst) {
            return Err(StoreError::Db("injected write failure".into()));
        }
        Ok(self.db.begin_write()?)
    }

    pub fn put_job(&self, rec: &JobRecord) -> Result<()> {
        let tx = self.begin_write()?;
        {
            let mut jobs = tx.open_table(JOBS)?;
            jobs.insert(rec.id.as_str(), json(rec).as_slice())?;
        }
        tx.commit()?;
        Ok(())
    }

    /// The job record and its step record, atomically.
    pub fn commit_step(&self, rec: &JobRecord, step: StepRecord) -> Result<()> {
        let tx = self.begin_write()?;
        {
            let mut jobs = tx.open_table(JOBS)?;
            jobs.insert(rec.id.as_str(), json(rec).as_slice())?;
            let mut steps = tx.open_table(STEPS)?;
            steps.insert(
                (rec.id.as_str(), step.metrics.step),
                compact(step).as_slice(),
            )?;
        }
        tx.commit()?;
        Ok(())
    }

    /// The move of `job`'s step records but the newest [`HOT_STEPS`] to a
    /// cold file, when redb holds twice that many at step `now` and no
    /// other move runs; the caller runs it ([`Cooling::run`]), off any
    /// lock. A move that fails or is skipped is due again at the next
    /// commit (the records stay readable where they are).
    pub fn cooling(&self, job: &str, now: u64) -> Result<Option<Cooling>> {
        let first = {
            let tx = self.db.begin_read()?;
            let table = tx.open_table(STEPS)?;
            let first = match table.range((job, 0)..=(job, u64::MAX))?.next() {
                Some(row) => row?.0.value().1,
                None => return Ok(None),
            };
            if now + 1 < first + 2 * HOT_STEPS {
                return Ok(None);
            }
            first
        };
        if self.cooling.swap(true, Ordering::AcqRel) {
            return Ok(None);
        }
        // Only this move deletes records, and commits add newer ones: the
        // range stays what was checked here.
        Ok(Some(Cooling {
            db: Arc::clone(&self.db),
            dir: self.cold_dir(job),
            job: job.to_string(),
            first,
            last: now - HOT_STEPS,
            busy: Arc::clone(&self.cooling),
        }))
    }

    fn cold_dir(&self, job: &str) -> PathBuf {
        // Hex: a job id is any string, a directory name is not.
        let name: String = job.bytes().map(|b| format!("{b:02x}")).collect();
        self.cold.join(name)
    }

    /// `job`'s cold files whose last step is ≥ `from`, in step order.
    fn cold_files(&self, job: &str, from: u64, to: u64) -> Result<Vec<PathBuf>> {
        let dir = self.cold_dir(job);
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(StoreError::Db(format!("{}: {e}", dir.display()))),
        };
        let mut files = Vec::new();
        for entry in entries {
            let path = entry
                .map_err(|e| StoreError::Db(format!("{}: {e}", dir.display())))?
                .path();
            let span = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".steps"))
                .and_then(|n| n.split_once('-'))
                .and_then(|(a, b)| Some((a.parse::<u64>().ok()?, b.parse::<u64>().ok()?)));
            // Anything else (a half-written `.tmp`) is not a cold file.
            if let Some((first, _)) = span.filter(|&(first, last)| last >= from && first <= to) {
                files.push((first, path));
            }
        }
        files.sort();
        Ok(files.into_iter().map(|(_, p)| p).collect())
    }

    /// Adds reference log-probs of `job`, in one transaction.
    pub fn put_reference(&self, job: &str, entries: &[(DocId, RefEntry)]) -> Result<()> {
        let tx = self.begin_write()?;
        {
            let mut pairs = tx.open_table(REFERENCE)?;
            let mut tokens = tx.open_table(REFERENCE_TOKENS)?;
            for (d, e) in entries {
                let key = (job, d.file, d.line);
                match e {
                    RefEntry::Pair([c, r]) => {
                        pairs.insert(key, (*c, *r))?;
                    }
                    RefEntry::Tokens(t) => {
                        tokens.insert(key, accrue_proto::pack_f32(t).as_slice())?;
                    }
                }
            }
        }
        tx.commit()?;
        Ok(())
    }

    /// The reference log-probs stored for `job`.
    pub fn reference(&self, job: &str) -> Result<ReferenceLogps> {
        let tx = self.db.begin_read()?;
        let range = (job, 0u32, 0u64)..=(job, u32::MAX, u64::MAX);
        let mut out = ReferenceLogps::new();
        for row in tx.open_table(REFERENCE)?.range(range.clone())? {
            let (k, v) = row?;
            let (_, file, line) = k.value();
            let (c, r) = v.value();
            out.insert(DocId { file, line }, RefEntry::Pair([c, r]));
        }
        for row in tx.open_table(REFERENCE_TOKENS)?.range(range)? {
            let (k, v) = row?;
            let (_, file, line) = k.value();
            let id = DocId { file, line };
            let t = accrue_proto::unpack_f32(v.value()).map_err(|e| StoreError::Corrupt {
                what: format!("reference_tokens of {job} {id}"),
                message: e.to_string(),
            })?;
            out.insert(id, RefEntry::Tokens(t.into()));
        }
        Ok(out)
    }

    /// Applies a streamed job's rollout write (insert, then delete, then
    /// the meta) in one transaction.
    pub fn put_rollouts(&self, w: &crate::rl::stream::RolloutWrite) -> Result<()> {
        let job = w.job.as_str();
        let tx = self.begin_write()?;
        {
            let mut t = tx.open_table(ROLLOUTS)?;
            for d in &w.admit {
                t.insert((job, d.id.line), json(&d.body).as_slice())?;
            }
            for id in &w.remove {
                t.remove((job, id.line))?;
            }
            let mut m = tx.open_table(STREAMS)?;
            m.insert(job, json(&w.meta).as_slice())?;
        }
        tx.commit()?;
        Ok(())
    }

    /// A streamed job's stored queue (rollouts in admission order), or
    /// `None` when nothing was ever pushed to it.
    pub fn stream(&self, job: &str) -> Result<Option<crate::rl::stream::StoredStream>> {
        let tx = self.db.begin_read()?;
        let metas = tx.open_table(STREAMS)?;
        let Some(meta) = metas.get(job)? else {
            return Ok(None);
        };
        let meta = decode(&format!("{job}/stream"), meta.value())?;
        let table = tx.open_table(ROLLOUTS)?;
        let mut rollouts = Vec::new();
        for row in table.range((job, 0u64)..=(job, u64::MAX))? {
            let (k, v) = row?;
            let (_, line) = k.value();
            rollouts.push(crate::stream::doc::Document {
                id: DocId {
                    file: crate::rl::stream::STREAM_FILE,
                    line,
                },
                body: decode(&format!("{job}/rollout/{line}"), v.value())?,
            });
        }
        Ok(Some(crate::rl::stream::StoredStream { meta, rollouts }))
    }

    /// Every job, in submission order.
    /// This coordinator's id, generated the first time its state dir is
    /// used and kept there: the output markers of its jobs name it, so a
    /// second coordinator on the same volume (another state dir) can tell
    /// the jobs apart from its own.
    pub fn coordinator_id(&self) -> Result<String> {
        let tx = self.begin_write()?;
        let id = {
            let mut meta = tx.open_table(META)?;
            let stored = meta.get(COORDINATOR_ID)?.map(|v| v.value().to_string());
            match stored {
                Some(id) => id,
                None => {
                    let id = uuid::Uuid::new_v4().to_string();
                    meta.insert(COORDINATOR_ID, id.as_str())?;
                    id
                }
            }
        };
        tx.commit()?;
        Ok(id)
    }

    pub fn jobs(&self) -> Result<Vec<JobRecord>> {
        let tx = self.db.begin_read()?;
        let table = tx.open_table(JOBS)?;
        let mut out = Vec::new();
        for row in table.iter()? {
            let (k, v) = row?;
            out.push(decode::<JobRecord>(k.value(), v.value())?);
        }
        out.sort_by(|a, b| {
            a.submitted_unix_ms
                .cmp(&b.submitted_unix_ms)
                .then(a.id.cmp(&b.id))
        });
        Ok(out)
    }

    /// Bytes the step records of `job` take as stored (keys aside), in
    /// redb and in the cold files.
    pub fn steps_bytes(&self, job: &str) -> Result<u64> {
        Ok(self.hot_steps(job)?.1 + self.cold_bytes(job)?)
    }

    /// How many step records of `job` are in redb, and their bytes.
    pub fn hot_steps(&self, job: &str) -> Result<(u64, u64)> {
        let tx = self.db.begin_read()?;
        let table = tx.open_table(STEPS)?;
        let (mut n, mut total) = (0, 0);
        for row in table.range((job, 0)..=(job, u64::MAX))? {
            n += 1;
            total += row?.1.value().len() as u64;
        }
        Ok((n, total))
    }

    fn cold_bytes(&self, job: &str) -> Result<u64> {
        let mut total = 0;
        for f in self.cold_files(job, 0, u64::MAX)? {
            total += std::fs::metadata(&f)
                .map_err(|e| StoreError::Db(format!("{}: {e}", f.display())))?
                .len();
        }
        Ok(total)
    }

    /// The metrics of `job`'s steps ≥ `from`, in step order, at most
    /// `limit`, each handed to `f` as it is read (nothing else of a record
    /// is decoded, nothing is collected): what the status page reads, off
    /// the coordinator's lock.
    pub fn step_metrics(
        &self,
        job: &str,
        from: u64,
        limit: usize,
        mut f: impl FnMut(StepMetrics),
    ) -> Result<()> {
        let mut left = limit;
        let mut last = None::<u64>;
        let tx = self.db.begin_read()?;
        for file in self.cold_files(job, from, u64::MAX)? {
            for (step, bytes) in read_cold(&file)? {
                if left == 0 {
                    return Ok(());
                }
                if step >= from && last.is_none_or(|l| step > l) {
                    let key = format!("{}#{step}", file.display());
                    f(records::step_metrics(&key, &bytes)?);
                    last = Some(step);
                    left -= 1;
                }
            }
        }
        let start = last.map_or(from, |l| l + 1).max(from);
        let table = tx.open_table(STEPS)?;
        for row in table.range((job, start)..=(job, u64::MAX))? {
            if left == 0 {
                break;
            }
            let (k, v) = row?;
            let (_, step) = k.value();
            f(records::step_metrics(&format!("{job}/{step}"), v.value())?);
            left -= 1;
        }
        Ok(())
    }

    /// Step records of `job` with step ≥ `from`, in step order: the cold
    /// files', then redb's.
    pub fn steps(&self, job: &str, from: u64) -> Result<Vec<StepRecord>> {
        self.steps_between(job, from, u64::MAX)
    }

    /// `job`'s step records `from..=to`, in step order (redb and cold
    /// files; only the cold files that overlap are read).
    pub fn steps_between(&self, job: &str, from: u64, to: u64) -> Result<Vec<StepRecord>> {
        let mut out = BTreeMap::new();
        // redb's snapshot before the listing: a record a concurrent
        // [`Cooling`] deletes after the snapshot was renamed into a cold
        // file before it, so the listing holds it.
        let tx = self.db.begin_read()?;
        for f in self.cold_files(job, from, to)? {
            for (step, bytes) in read_cold(&f)? {
                if (from..=to).contains(&step) {
                    let key = format!("{}#{step}", f.display());
                    out.insert(step, step_record(&key, &bytes)?);
                }
            }
        }
        let table = tx.open_table(STEPS)?;
        for row in table.range((job, from)..=(job, to))? {
            let (k, v) = row?;
            let (_, step) = k.value();
            out.insert(step, step_record(&format!("{job}/{step}"), v.value())?);
        }
        Ok(out.into_values().collect())
    }
}

impl Cooling {
    /// Moves the records. The file is complete on disk (written aside,
    /// synced, renamed) before the records leave redb; a crash in between
    /// leaves both, and readers take one.
    pub fn run(self) -> Result<()> {
        let job = self.job.as_str();
        let rows: Vec<(u64, Vec<u8>)> = {
            let tx = self.db.begin_read()?;
            let table = tx.open_table(STEPS)?;
            let mut rows = Vec::new();
            for row in table.range((job, self.first)..=(job, self.last))? {
                let (k, v) = row?;
                rows.push((k.value().1, v.value().to_vec()));
            }
            rows
        };
        let (Some(&(first, _)), Some(&(last, _))) = (rows.first(), rows.last()) else {
            return Ok(());
        };
        let dir = &self.dir;
        let path = dir.join(format!("{first:020}-{last:020}.steps"));
        write_cold(dir, &path, &rows).map_err(|e| StoreError::Corrupt {
            what: path.display().to_string(),
            message: format!("writing: {e}"),
        })?;
        let tx = self.db.begin_write()?;
        {
            let mut table = tx.open_table(STEPS)?;
            for (step, _) in &rows {
                table.remove((job, *step))?;
            }
        }
        tx.commit()?;
        Ok(())
    }
}

/// What replaying `job`'s committed steps from `from` on needs (their
/// manifests and learning rates), read from the step records.
pub fn committed_steps(store: &Store, job: &str, from: u64) -> Result<Vec<CommittedStep>> {
    committed_steps_between(store, job, from, u64::MAX)
}

/// The same for steps `from..=to` only (a replay loading back the part of
/// its history the coordinator no longer holds in memory).
pub fn committed_steps_between(
    store: &Store,
    job: &str,
    from: u64,
    to: u64,
) -> Result<Vec<CommittedStep>> {
    Ok(store
        .steps_between(job, from, to)?
        .into_iter()
        .map(|r| CommittedStep {
            step: r.metrics.step,
            lr: r.metrics.lr,
            cursor_after: r.metrics.cursor,
            docs: r.docs.into(),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::records::{ZSTD, ZSTD_BINARY};
    use super::*;
    use crate::core::{JobState, StepMetrics};
    use crate::stream::cursor::Cursor;

    fn rec(id: &str, t: i64) -> JobRecord {
        JobRecord {
            id: id.into(),
            name: "n".into(),
            spec_toml: "x".into(),
            state: JobState::Running,
            reason: String::new(),
            step: 0,
            cursor: Cursor::default(),
            generation: 1,
            submitted_unix_ms: t,
            last_loss: None,
            documents: 10,
            total_steps: 5,
            last_checkpoint: None,
            resumed_from: None,
            changes: Vec::new(),
            checkpoints: Vec::new(),
            bad_checkpoints: Vec::new(),
            history_from: 0,
            members: Vec::new(),
            quarantine: Vec::new(),
        }
    }

    /// Issue 33 (8): one id per state dir, kept across restarts.
    #[test]
    fn the_coordinator_id_is_made_once_per_state_dir() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let id = Store::open(a.path()).unwrap().coordinator_id().unwrap();
        assert_eq!(id, Store::open(a.path()).unwrap().coordinator_id().unwrap());
        assert_ne!(id, Store::open(b.path()).unwrap().coordinator_id().unwrap());
    }

    #[test]
    fn jobs_and_steps_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = Store::open(dir.path()).unwrap();
            s.put_job(&rec("b", 2)).unwrap();
            let mut a = rec("a", 1);
            s.put_job(&a).unwrap();
            for step in 1..=3 {
                a.step = step;
                a.cursor = Cursor {
                    epoch: 0,
                    position: step * 4,
                    overflow: vec![step],
                    ..Default::default()
                };
                let m = StepMetrics {
                    step,
                    loss: 1.0 / step as f64,
                    ..Default::default()
                };
                s.commit_step(
                    &a,
                    StepRecord {
                        metrics: m,
                        docs: vec![DocId {
                            file: 0,
                            line: step,
                        }],
                        manifest: None,
                    },
                )
                .unwrap();
            }
        }
        let s = Store::open(dir.path()).unwrap();
        let jobs = s.jobs().unwrap();
        assert_eq!(
            jobs.iter().map(|j| j.id.as_str()).collect::<Vec<_>>(),
            vec!["a", "b"]
        );
        assert_eq!(jobs[0].step, 3);
        assert_eq!(jobs[0].cursor.position, 12);
        let steps = s.steps("a", 2).unwrap();
        assert_eq!(
            steps.iter().map(|r| r.metrics.step).collect::<Vec<_>>(),
            vec![2, 3]
        );
        assert_eq!(steps[1].docs, vec![DocId { file: 0, line: 3 }]);
        assert!(s.steps("b", 0).unwrap().is_empty());
    }

    /// Issue 19, bounded state: a 16k-document step (1024 ranks of 16) is
    /// stored in a few bytes per document, its list not repeated beside the
    /// manifest; a plain JSON record (written before) still reads.
    #[test]
    fn a_large_step_is_stored_compact_and_old_records_still_read() {
        use crate::core::manifest::{MicrobatchEntry, SeqEntry, StepManifest};
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let ranks: Vec<Vec<MicrobatchEntry>> = (0..1024)
            .map(|_| {
                let seqs = (0..16)
                    .map(|_| {
                        // xorshift: documents from a shuffled 200k dataset.
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        let id = DocId {
                            file: 0,
                            line: 1 + rng % 200_000,
                        };
                        SeqEntry(id, 0, 10 + (rng % 50) as u32)
                    })
                    .collect();
                vec![MicrobatchEntry { tokens: 500, seqs }]
            })
            .collect();
        let manifest = StepManifest {
            step: 7,
            generation: 1,
            world_size: 1024,
            lr: 1e-4,
            settings: Default::default(),
            epoch: 0,
            tokens: 512_000,
            attempts: 1,
            replayed: false,
            files: Default::default(),
            sources: Default::default(),
            groups: Vec::new(),
            ranks,
        };
        let record = StepRecord {
            metrics: StepMetrics {
                step: 7,
                ..Default::default()
            },
            docs: manifest.docs(),
            manifest: Some(manifest),
        };
        let stored = compact(record.clone());
        assert_eq!(stored[0], ZSTD_BINARY);
        let per_doc = stored.len() as f64 / 16_384.0;
        let plain = json(&record).len() as f64 / 16_384.0;
        eprintln!("{per_doc:.2} bytes per document stored ({plain:.1} as JSON)");
        assert!(
            per_doc < 5.0,
            "{per_doc:.1} bytes per document stored ({plain:.1} as JSON)"
        );
        assert_eq!(step_record("a/7", &stored).unwrap(), record);
        assert_eq!(step_record("a/7", &json(&record)).unwrap(), record);
        // The form before the binary layout: zstd over the whole JSON.
        let mut zstd_json = vec![ZSTD];
        zstd::stream::copy_encode(json(&record).as_slice(), &mut zstd_json, 1).unwrap();
        assert_eq!(step_record("a/7", &zstd_json).unwrap(), record);
    }

    /// A record whose document list is not its layout's (or that has no
    /// layout) keeps the list; a damaged record is an error naming it.
    #[test]
    fn a_compact_record_keeps_a_list_its_layout_does_not_give_and_damage_is_named() {
        use crate::core::manifest::{MicrobatchEntry, SeqEntry, StepManifest};
        let id = |line| DocId { file: 1, line };
        let manifest = StepManifest {
            step: 3,
            generation: 2,
            world_size: 2,
            lr: 0.5,
            settings: Default::default(),
            epoch: 1,
            tokens: 9,
            attempts: 2,
            replayed: true,
            files: [(1, "web".to_string())].into(),
            sources: [("web".to_string(), 2)].into(),
            groups: vec!["p@0".into()],
            ranks: vec![
                vec![MicrobatchEntry {
                    tokens: 4,
                    seqs: vec![SeqEntry(id(5), 0, 2), SeqEntry(id(5), 1, 2)],
                }],
                vec![MicrobatchEntry {
                    tokens: 5,
                    seqs: vec![SeqEntry(id(9), 0, 5)],
                }],
            ],
        };
        let metrics = StepMetrics {
            step: 3,
            loss: 1.5,
            ..Default::default()
        };
        for record in [
            StepRecord {
                metrics: metrics.clone(),
                docs: vec![id(9), id(5)],
                manifest: Some(manifest.clone()),
            },
            StepRecord {
                metrics: metrics.clone(),
                docs: vec![id(5), id(9)],
                manifest: Some(manifest),
            },
            StepRecord {
                metrics,
                docs: vec![id(7)],
                manifest: None,
            },
        ] {
            let stored = compact(record.clone());
            assert_eq!(step_record("a/3", &stored).unwrap(), record);
        }
        let mut body = Vec::new();
        prost::encoding::encode_varint(1_000, &mut body);
        body.extend_from_slice(b"{}");
        let mut damaged = vec![ZSTD_BINARY];
        zstd::stream::copy_encode(body.as_slice(), &mut damaged, 1).unwrap();
        let err = step_record("a/3", &damaged).unwrap_err().to_string();
        assert!(err.contains("a/3") && err.contains("cut short"), "{err}");
    }

    #[test]
    fn a_step_with_non_finite_metrics_keeps_the_job_readable() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = Store::open(dir.path()).unwrap();
            let mut a = rec("a", 1);
            a.step = 1;
            a.last_loss = Some(f64::NAN);
            let mut m = StepMetrics {
                step: 1,
                loss: f64::NAN,
                grad_norm: f64::INFINITY,
                ..Default::default()
            };
            m.extra.insert("rewards/margin".into(), f64::NEG_INFINITY);
            let r = StepRecord {
                metrics: m,
                docs: vec![],
                manifest: None,
            };
            s.commit_step(&a, r).unwrap();
        }
        let s = Store::open(dir.path()).unwrap();
        let jobs = s.jobs().unwrap();
        assert_eq!(jobs[0].step, 1);
        let steps = s.steps("a", 0).unwrap();
        let m = &steps[0].metrics;
        // JSON has no NaN or inf: they are stored as null and read as NaN.
        assert!(m.loss.is_nan());
        assert!(m.grad_norm.is_nan());
        assert!(m.extra["rewards/margin"].is_nan());
    }

    #[test]
    fn streamed_rollouts_are_kept_until_removed() {
        use crate::rl::stream::{RolloutWrite, StreamMeta};
        use crate::stream::doc::{DocBody, Document, Rollout};
        let dir = tempfile::tempdir().unwrap();
        let doc = |line| Document {
            id: DocId { file: 0, line },
            body: DocBody::Rollout(Rollout {
                reward: line as f64,
                group: "g".into(),
                ..Default::default()
            }),
        };
        let write = |admit: Vec<Document>, remove: Vec<u64>, head| RolloutWrite {
            job: "a".into(),
            admit,
            remove: remove
                .into_iter()
                .map(|line| DocId { file: 0, line })
                .collect(),
            meta: StreamMeta {
                head,
                next_line: 9,
                ..Default::default()
            },
            counts: None,
        };
        {
            let s = Store::open(dir.path()).unwrap();
            assert!(s.stream("a").unwrap().is_none());
            s.put_rollouts(&write(vec![doc(1), doc(2), doc(3)], vec![], 0))
                .unwrap();
            s.put_rollouts(&write(vec![doc(4)], vec![1, 4], 1)).unwrap();
        }
        let s = Store::open(dir.path()).unwrap();
        let got = s.stream("a").unwrap().unwrap();
        assert_eq!(got.meta.head, 1);
        assert_eq!(got.rollouts, vec![doc(2), doc(3)]);
        assert!(s.stream("b").unwrap().is_none());
    }

    #[test]
    fn reference_logps_are_kept_per_job() {
        let dir = tempfile::tempdir().unwrap();
        let id = |line| DocId { file: 1, line };
        let pair = |c, r| RefEntry::Pair([c, r]);
        {
            let s = Store::open(dir.path()).unwrap();
            s.put_reference("a", &[(id(1), pair(-1.0, -2.0)), (id(7), pair(-3.5, -4.0))])
                .unwrap();
            s.put_reference("b", &[(id(1), pair(-9.0, -9.0))]).unwrap();
            s.put_reference("a", &[(id(2), pair(-5.0, -6.0))]).unwrap();
            s.put_reference(
                "r",
                &[(id(3), RefEntry::Tokens(vec![0.0, -0.25, -1.5].into()))],
            )
            .unwrap();
        }
        let s = Store::open(dir.path()).unwrap();
        let a = s.reference("a").unwrap();
        assert_eq!(a.len(), 3);
        assert_eq!(a[&id(7)], pair(-3.5, -4.0));
        assert_eq!(s.reference("b").unwrap()[&id(1)], pair(-9.0, -9.0));
        assert!(s.reference("c").unwrap().is_empty());
        let r = s.reference("r").unwrap();
        assert_eq!(r.len(), 1);
        assert_eq!(r[&id(3)], RefEntry::Tokens(vec![0.0, -0.25, -1.5].into()));
    }

    #[test]
    fn manifests_and_settings_changes_survive_reopen() {
        use crate::core::manifest::{MicrobatchEntry, SeqEntry, StepManifest};
        use crate::job::settings::{ConfigChange, JobUpdate, StepSettings};
        let dir = tempfile::tempdir().unwrap();
        let mut a = rec("a", 1);
        a.step = 1;
        a.changes = vec![ConfigChange {
            from_step: 2,
            update: JobUpdate {
                docs_per_step: Some(6),
                lr: Some(2e-4),
                ..Default::default()
            },
            unix_ms: 5,
        }];
        let doc = |line| DocId { file: 1, line };
        let manifest = StepManifest {
            step: 1,
            generation: 3,
            world_size: 2,
            lr: 1e-4,
            settings: StepSettings {
                size: crate::job::batch::StepSize::Docs(2),
                max_tokens: 64,
                base_lr: 1e-4,
            },
            epoch: 0,
            tokens: 30,
            attempts: 2,
            replayed: false,
            files: Default::default(),
            sources: Default::default(),
            groups: Vec::new(),
            ranks: vec![
                vec![MicrobatchEntry {
                    tokens: 20,
                    seqs: vec![SeqEntry(doc(4), 0, 12), SeqEntry(doc(4), 1, 8)],
                }],
                vec![MicrobatchEntry {
                    tokens: 10,
                    seqs: vec![SeqEntry(doc(9), 0, 10)],
                }],
            ],
        };
        {
            let s = Store::open(dir.path()).unwrap();
            let record = StepRecord {
                metrics: StepMetrics {
                    step: 1,
                    ..Default::default()
                },
                docs: vec![doc(4), doc(9)],
                manifest: Some(manifest.clone()),
            };
            s.commit_step(&a, record).unwrap();
        }
        let s = Store::open(dir.path()).unwrap();
        assert_eq!(s.jobs().unwrap()[0].changes, a.changes);
        let steps = s.steps("a", 0).unwrap();
        assert_eq!(steps[0].manifest.as_ref(), Some(&manifest));
        assert_eq!(steps[0].manifest.as_ref().unwrap().docs(), steps[0].docs);
    }

    #[test]
    fn old_step_records_move_to_cold_files_and_stay_readable() {
        use crate::core::manifest::{MicrobatchEntry, SeqEntry, StepManifest};
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("accrue.redb");
        let docs = |step: u64| -> Vec<DocId> {
            (0..256)
                .map(|i| DocId {
                    file: 0,
                    line: (step * 7919 + i * 104_729) % 1_000_003,
                })
                .collect()
        };
        let record = |step: u64| StepRecord {
            metrics: StepMetrics {
                step,
                loss: step as f64,
                ..Default::default()
            },
            docs: docs(step),
            manifest: Some(StepManifest {
                step,
                generation: 1,
                world_size: 1,
                lr: 1e-4,
                settings: Default::default(),
                epoch: 0,
                tokens: 256,
                attempts: 1,
                replayed: false,
                files: Default::default(),
                sources: Default::default(),
                groups: Vec::new(),
                ranks: vec![vec![MicrobatchEntry {
                    tokens: 256,
                    seqs: docs(step).into_iter().map(|d| SeqEntry(d, 0, 1)).collect(),
                }]],
            }),
        };
        let mut a = rec("a/b c", 1);
        let mut size_at = BTreeMap::new();
        let last = 16 * HOT_STEPS;
        {
            let s = Store::open(dir.path()).unwrap();
            for step in 1..=last {
                a.step = step;
                s.commit_step(&a, record(step)).unwrap();
                if let Some(cooling) = s.cooling(&a.id, step).unwrap() {
                    // One move at a time: a second is not handed out.
                    assert!(s.cooling(&a.id, step).unwrap().is_none());
                    cooling.run().unwrap();
                }
                let (hot, _) = s.hot_steps(&a.id).unwrap();
                assert!(hot < 2 * HOT_STEPS, "{hot} records in redb at step {step}");
                size_at.insert(step, std::fs::metadata(&db).unwrap().len());
            }
        }
        // The database stops growing with steps: no bigger after 16
        // windows than after 4 (without the move it grows ~4x).
        assert!(size_at[&last] <= size_at[&(4 * HOT_STEPS)], "{size_at:?}");
        // After a restart every step reads back, from the cold files and
        // redb alike: replay from any step, the whole manifest history.
        let s = Store::open(dir.path()).unwrap();
        let all = s.steps(&a.id, 0).unwrap();
        assert_eq!(all.len() as u64, last);
        for (i, r) in all.iter().enumerate() {
            assert_eq!(r, &record(i as u64 + 1));
        }
        let replay = committed_steps(&s, &a.id, 100).unwrap();
        assert_eq!(
            replay.iter().map(|c| c.step).collect::<Vec<_>>(),
            (100..=last).collect::<Vec<_>>()
        );
        assert_eq!(replay[0].docs.to_vec(), docs(100));
        // A replay loading part of its history back reads just that range,
        // across a cold file's edge and into redb.
        for (from, to) in [
            (5, 9),
            (HOT_STEPS - 2, HOT_STEPS + 3),
            (last - 3, last + 10),
        ] {
            let part = committed_steps_between(&s, &a.id, from, to).unwrap();
            assert_eq!(
                part.iter().map(|c| c.step).collect::<Vec<_>>(),
                (from..=to.min(last)).collect::<Vec<_>>()
            );
            assert_eq!(part[0].docs.to_vec(), docs(from));
        }
        // A record in both places (a crash between the cold file's rename
        // and redb's delete) is read once.
        s.commit_step(&a, record(3)).unwrap();
        assert_eq!(s.steps(&a.id, 0).unwrap().len() as u64, last);
        assert!(s.steps("other", 0).unwrap().is_empty());
    }
}
