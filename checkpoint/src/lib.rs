//! The checkpoint directory, the contract between the workers that write
//! it and the coordinator that admits, resumes and exports it (issue 6: "a
//! crash mid-write never corrupts the latest good checkpoint").
//!
//! `OUTPUT_DIR/checkpoints/step-N/` holds the weights (`config.json`,
//! `model.safetensors` or its shards), the optimizer state, and:
//! - `rank-R.json` ([`RankMarker`]): every file rank R wrote, with its size
//!   and CRC-32, written by that rank last, once its files are durable
//!   ([`write_marker`]);
//! - `manifest.json` ([`Manifest`]): the job, step, data cursor, world size
//!   and generation, written by rank 0 after its own marker.
//!
//! A checkpoint is **complete** when `manifest.json` and the markers of
//! ranks `0..world_size` exist, and **intact** when every listed file has
//! its size and checksum; [`verify`] checks both (workers before a restore,
//! the coordinator at submit) and names the first file missing or wrong.
//! A directory with a manifest but no marker at all predates markers: it
//! passes unverified ([`Verified::marked`] is false) so that older
//! checkpoints still resume.
//!
//! **The resume rule.** A job whose `model.init` is a checkpoint of ours
//! (a directory with `manifest.json`) starts at the manifest's step and
//! data cursor with the checkpoint's optimizer state, whatever its name;
//! with `model.resume = false` it takes only the weights (step 0, a fresh
//! optimizer, its own data stream). [`Manifest::resume_point`] is that
//! rule.

mod durable;
mod manifest;
mod marker;
mod read;
mod verify;

pub use durable::{sync_dir, write_durable};
pub use manifest::{read_manifest, Cursor, Manifest, SourcePos, MANIFEST};
pub use marker::{marker_name, measure, write_marker, MarkedFile, RankMarker};
pub use read::{VerifyError, MAX_JSON_BYTES};
pub use verify::{verify, Verified};
