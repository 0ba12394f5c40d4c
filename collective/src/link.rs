//! Who may take a ring link, and what protects its bytes (issue 33).
//!
//! Every generation's ring has a secret, [`LinkKey`], that the coordinator
//! hands each member in its Configure (over the coordinator's session, TLS
//! when configured). The connect handshake carries an HMAC-SHA256 over the
//! hello and a fresh nonce from each side, so a connection from anyone
//! without the key is refused without consequence (it neither takes the
//! link nor fails the generation), and a dialer knows it reached a peer
//! holding the key. With `seal` set (the coordinator runs with TLS), every
//! piece after the handshake is AES-256-GCM sealed under a key derived from
//! the secret and both nonces, its header the associated data: payloads
//! are private and a changed byte fails the operation.
//!
//! Why not TLS on the link: rustls has no external pre-shared keys, and a
//! certificate per generation would need a CA the workers trust; the two
//! ends here already share a secret, so a MAC'd handshake and an AEAD on
//! the pieces (both from `ring`, which rustls already builds) are the
//! whole need.

use ring::{aead, hmac};

use crate::error::{CollectiveError, CollectiveResult};

/// Bytes of a handshake nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of a handshake MAC (HMAC-SHA256).
pub const MAC_LEN: usize = 32;
/// Bytes an AEAD seal adds to a piece.
pub const TAG_LEN: usize = 16;

/// The secret of one generation's ring, and whether its pieces are sealed.
#[derive(Clone)]
pub struct LinkKey {
    key: hmac::Key,
    seal: bool,
}

impl std::fmt::Debug for LinkKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the secret: configs are logged.
        write!(f, "LinkKey {{ seal: {} }}", self.seal)
    }
}

impl LinkKey {
    /// The key from the coordinator's secret (at least 16 bytes).
    pub fn new(secret: &[u8], seal: bool) -> CollectiveResult<LinkKey> {
        if secret.len() < 16 {
            return Err(CollectiveError::Setup(format!(
                "link key of {} bytes (at least 16)",
                secret.len()
            )));
        }
        Ok(LinkKey {
            key: hmac::Key::new(hmac::HMAC_SHA256, secret),
            seal,
        })
    }

    /// A fresh random key (tests, benchmarks: one process makes every
    /// rank's config).
    pub fn random(seal: bool) -> LinkKey {
        let secret: [u8; 32] = rand_bytes();
        LinkKey::new(&secret, seal).expect("32 bytes")
    }

    /// Whether pieces are sealed.
    pub fn seals(&self) -> bool {
        self.seal
    }

    /// HMAC-SHA256 of `label` and `parts` (each length-prefixed).
    pub fn mac(&self, label: &[u8], parts: &[&[u8]]) -> [u8; MAC_LEN] {
        let mut ctx = hmac::Context::with_key(&self.key);
        ctx.update(label);
        for p in parts {
            ctx.update(&(p.len() as u64).to_le_bytes());
            ctx.update(p);
        }
        let mut out = [0u8; MAC_LEN];
        out.copy_from_slice(ctx.sign().as_ref());
        out
    }

    /// Whether `tag` is the MAC of `parts` (constant time).
    pub fn verify(&self, label: &[u8], parts: &[&[u8]], tag: &[u8]) -> bool {
        let want = self.mac(label, parts);
        bool::from(subtle::ConstantTimeEq::ct_eq(&want[..], tag))
    }

    /// The sealing of one connection's pieces (dialer to acceptor), from
    /// both handshake nonces: a fresh key per connection, so counters
    /// starting at 0 never repeat a nonce under one key.
    pub fn sealing(&self, dialer: &[u8], acceptor: &[u8]) -> Option<Sealing> {
        if !self.seal {
            return None;
        }
        let k = self.mac(b"accrue link stream", &[dialer, acceptor]);
        let key = aead::UnboundKey::new(&aead::AES_256_GCM, &k).expect("32-byte key");
        Some(Sealing {
            key: aead::LessSafeKey::new(key),
            counter: 0,
            buf: Vec::new(),
        })
    }
}

/// Random bytes from the system's generator (handshake nonces).
pub fn rand_bytes<const N: usize>() -> [u8; N] {
    use ring::rand::SecureRandom;
    let mut b = [0u8; N];
    ring::rand::SystemRandom::new()
        .fill(&mut b)
        .expect("the system's random generator");
    b
}

/// One direction's AEAD state: the key and the count of pieces so far
/// (the nonce), and a buffer for the sealed bytes.
pub struct Sealing {
    key: aead::LessSafeKey,
    counter: u64,
    buf: Vec<u8>,
}

impl Sealing {
    fn nonce(&mut self) -> aead::Nonce {
        let mut n = [0u8; aead::NONCE_LEN];
        n[4..].copy_from_slice(&self.counter.to_le_bytes());
        self.counter += 1;
        aead::Nonce::assume_unique_for_key(n)
    }

    /// `payload` sealed with `header` as associated data: the bytes to
    /// send after the header (payload length + [`TAG_LEN`]).
    pub fn seal(&mut self, header: &[u8], payload: &[u8]) -> &[u8] {
        let nonce = self.nonce();
        self.buf.clear();
        self.buf.extend_from_slice(payload);
        let tag = self
            .key
            .seal_in_place_separate_tag(nonce, aead::Aad::from(header), &mut self.buf)
            .expect("a piece within AES-GCM's length limit");
        self.buf.extend_from_slice(tag.as_ref());
        &self.buf
    }

    /// Opens `sealed` (payload + tag, as [`Self::seal`] made it) in place:
    /// the payload, or None when a byte of it or of `header` changed.
    pub fn open<'a>(&mut self, header: &[u8], sealed: &'a mut [u8]) -> Option<&'a [u8]> {
        let nonce = self.nonce();
        self.key
            .open_in_place(nonce, aead::Aad::from(header), sealed)
            .ok()
            .map(|p| &*p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_piece_opens_once_and_only_unchanged() {
        let key = LinkKey::random(true);
        let (d, a) = (rand_bytes::<32>(), rand_bytes::<32>());
        let mut tx = key.sealing(&d, &a).unwrap();
        let mut rx = key.sealing(&d, &a).unwrap();
        let header = [7u8; 48];
        let mut sealed = tx.seal(&header, b"gradients").to_vec();
        assert_eq!(sealed.len(), 9 + TAG_LEN);
        assert_ne!(&sealed[..9], b"gradients");
        assert_eq!(
            rx.open(&header, &mut sealed.clone()),
            Some(&b"gradients"[..])
        );
        // The same piece again (a replay) is refused: the counter moved.
        assert_eq!(rx.open(&header, &mut sealed.clone()), None);
        // A flipped bit, or another header, is refused.
        let mut rx = key.sealing(&d, &a).unwrap();
        sealed[0] ^= 1;
        assert_eq!(rx.open(&header, &mut sealed), None);
        let mut rx = key.sealing(&d, &a).unwrap();
        let mut sealed = tx.seal(&header, b"x").to_vec();
        let _ = rx.open(&header, &mut [0u8; TAG_LEN + 9]);
        assert_eq!(rx.open(&[8u8; 48], &mut sealed), None);
        // Another key's sealing cannot open it.
        assert!(LinkKey::random(true).sealing(&d, &a).is_some());
        assert!(LinkKey::random(false).sealing(&d, &a).is_none());
    }

    #[test]
    fn macs_bind_the_key_and_every_part() {
        let key = LinkKey::new(&[1u8; 32], false).unwrap();
        let tag = key.mac(b"l", &[b"ab", b"c"]);
        assert!(key.verify(b"l", &[b"ab", b"c"], &tag));
        // Part boundaries count: "ab"+"c" is not "a"+"bc".
        assert!(!key.verify(b"l", &[b"a", b"bc"], &tag));
        assert!(!key.verify(b"m", &[b"ab", b"c"], &tag));
        let other = LinkKey::new(&[2u8; 32], false).unwrap();
        assert!(!other.verify(b"l", &[b"ab", b"c"], &tag));
        assert!(LinkKey::new(&[0u8; 8], false).is_err());
        assert_eq!(format!("{key:?}"), "LinkKey { seal: false }");
    }
}
