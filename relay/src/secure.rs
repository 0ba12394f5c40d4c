//! The handshake and sealing of a relay connection (issue 33). The hub
//! speaks first with a fresh challenge; the follower's hello carries its
//! own nonce and an HMAC under its group's key over the challenge and what
//! it claims (job, generation, rank); the hub answers with an HMAC over
//! the challenge and that hello, proving it holds the key too. Then every
//! frame the hub forwards is AES-256-GCM sealed under a key derived from
//! the group's key and both nonces, and a follower decodes only what
//! opens. A stranger's connection reads at most a 4 KiB hello and waits at
//! most [`HELLO_TIMEOUT`] before it is dropped; a stranger's frames never
//! open.

use std::time::Duration;

use accrue_collective::link::{LinkKey, Sealing, MAC_LEN, NONCE_LEN};
use accrue_proto::v1 as wire;
use wire::coordinator_message::Msg;

/// The largest hello a hub reads (a job id, three numbers, a nonce, a MAC).
pub(crate) const HELLO_MAX: usize = 4 << 10;
/// How long a new connection has to send its hello.
pub(crate) const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

const HELLO_LABEL: &[u8] = b"accrue relay hello";
const ACCEPT_LABEL: &[u8] = b"accrue relay accept";

/// A group's key, as the coordinator's `RelayRoute.token` carries it.
pub(crate) fn group_key(key: &[u8]) -> Result<LinkKey, String> {
    LinkKey::new(key, true).map_err(|e| format!("relay group key: {e}"))
}

/// A follower's signed hello answering `challenge`.
pub(crate) fn hello(
    key: &LinkKey,
    challenge: &[u8],
    job: &str,
    generation: u64,
    rank: u32,
) -> wire::RelayHello {
    let nonce = accrue_collective::link::rand_bytes::<NONCE_LEN>().to_vec();
    let mut h = wire::RelayHello {
        job_id: job.to_string(),
        generation,
        rank,
        nonce,
        mac: Vec::new(),
    };
    h.mac = hello_mac(key, challenge, &h).to_vec();
    h
}

fn hello_mac(key: &LinkKey, challenge: &[u8], h: &wire::RelayHello) -> [u8; MAC_LEN] {
    let parts: [&[u8]; 5] = [
        challenge,
        h.job_id.as_bytes(),
        &h.generation.to_le_bytes(),
        &h.rank.to_le_bytes(),
        &h.nonce,
    ];
    key.mac(HELLO_LABEL, &parts)
}

/// Whether `h` answers `challenge` under `key`.
pub(crate) fn hello_is_authentic(key: &LinkKey, challenge: &[u8], h: &wire::RelayHello) -> bool {
    h.nonce.len() == NONCE_LEN && {
        let parts: [&[u8]; 5] = [
            challenge,
            h.job_id.as_bytes(),
            &h.generation.to_le_bytes(),
            &h.rank.to_le_bytes(),
            &h.nonce,
        ];
        key.verify(HELLO_LABEL, &parts, &h.mac)
    }
}

/// The hub's answer to an authentic hello.
pub(crate) fn accept(key: &LinkKey, challenge: &[u8], h: &wire::RelayHello) -> [u8; MAC_LEN] {
    key.mac(ACCEPT_LABEL, &[challenge, &h.mac])
}

/// Whether the hub's `answer` proves it holds `key`.
pub(crate) fn accept_is_authentic(
    key: &LinkKey,
    challenge: &[u8],
    h: &wire::RelayHello,
    answer: &[u8],
) -> bool {
    key.verify(ACCEPT_LABEL, &[challenge, &h.mac], answer)
}

/// The sealing of the hub's frames to the follower of `h`.
pub(crate) fn sealing(key: &LinkKey, challenge: &[u8], h: &wire::RelayHello) -> Sealing {
    key.sealing(challenge, &h.nonce)
        .expect("a relay group key always seals")
}

/// Whether a follower of `generation` of `job` takes `msg` from its hub:
/// only what the coordinator relays (plans, weight syncs, checkpoint and
/// publish requests), and only its own job's and generation's. Configure,
/// Abort and Release come on the coordinator's session only.
pub(crate) fn relayable(
    job: &str,
    generation: u64,
    msg: &wire::CoordinatorMessage,
) -> Result<(), String> {
    let (kind, of_job, of_generation) = match &msg.msg {
        Some(Msg::StepPlan(p)) => ("a step plan", &p.job_id, Some(p.generation)),
        Some(Msg::GeneratePlan(p)) => ("a generate plan", &p.job_id, Some(p.generation)),
        Some(Msg::SyncWeights(s)) => ("a weight sync", &s.job_id, Some(s.generation)),
        Some(Msg::CheckpointRequest(c)) => ("a checkpoint request", &c.job_id, None),
        Some(Msg::PublishPolicy(p)) => ("a publish request", &p.job_id, None),
        Some(Msg::Configure(_)) => return Err("a Configure, which is never relayed".into()),
        Some(Msg::Abort(_)) => return Err("an Abort, which is never relayed".into()),
        Some(Msg::Release(_)) => return Err("a Release, which is never relayed".into()),
        Some(Msg::Relay(_)) => return Err("a Relay, which only the coordinator sends".into()),
        None => return Err("an empty message".into()),
    };
    if of_job != job || of_generation.is_some_and(|g| g != generation) {
        return Err(format!(
            "{kind} of job {of_job} generation {}, not this link's (job {job} generation {generation})",
            of_generation.map_or_else(|| "-".to_string(), |g| g.to_string())
        ));
    }
    Ok(())
}
