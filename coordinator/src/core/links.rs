//! The secrets of a generation's worker-to-worker links (issue 33): one
//! for its collective and weight rings, handed to every member in its
//! Configure, and one key per relay group, derived from a secret only the
//! coordinator holds, so that a group's hub and followers hold theirs and
//! no other group's. They travel only on the coordinator's sessions (TLS
//! when configured) and are never logged or shown.

use std::sync::Arc;

/// A secret's length: an HMAC-SHA256 key's.
const SECRET_LEN: usize = 32;

/// A generation's ring secret and whether its links seal their bytes.
#[derive(Clone, PartialEq)]
pub struct LinkSecret {
    pub key: Arc<[u8]>,
    /// Seal every piece (the coordinator runs with TLS, so the secret
    /// reached the workers privately).
    pub seal: bool,
}

impl std::fmt::Debug for LinkSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LinkSecret {{ seal: {} }}", self.seal)
    }
}

impl LinkSecret {
    /// A fresh secret for a new generation.
    pub fn generate(seal: bool) -> LinkSecret {
        LinkSecret {
            key: random_secret(),
            seal,
        }
    }
}

/// Fresh random bytes for a secret.
pub fn random_secret() -> Arc<[u8]> {
    rand::random::<[u8; SECRET_LEN]>().to_vec().into()
}

/// The key of the relay group whose hub is rank `hub`: HMAC-SHA256 of the
/// generation's relay secret and the hub's rank, so one group's key says
/// nothing about another's.
pub fn group_key(secret: &[u8], hub: u32) -> Arc<[u8]> {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
    let mut msg = b"accrue relay group ".to_vec();
    msg.extend_from_slice(&hub.to_le_bytes());
    ring::hmac::sign(&key, &msg).as_ref().to_vec().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_fresh_and_group_keys_differ_by_hub_and_secret() {
        let (a, b) = (random_secret(), random_secret());
        assert_ne!(a, b);
        assert_eq!(a.len(), 32);
        assert_eq!(group_key(&a, 0), group_key(&a, 0));
        assert_ne!(group_key(&a, 0), group_key(&a, 8));
        assert_ne!(group_key(&a, 0), group_key(&b, 0));
        assert_ne!(&group_key(&a, 0)[..], &a[..]);
        let s = LinkSecret::generate(true);
        assert_eq!(format!("{s:?}"), "LinkSecret { seal: true }");
    }
}
