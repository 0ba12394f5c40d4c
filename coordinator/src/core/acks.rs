//! Waiting for every member to acknowledge something (a checkpoint
//! written, a policy published, weights synced): per key, the workers that
//! still owe their answer. The one copy of "all members acked".

use std::collections::{BTreeMap, BTreeSet};

use super::types::WorkerId;

/// Per key, the workers whose acknowledgement is still owed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acks<K: Ord> {
    owed: BTreeMap<K, BTreeSet<WorkerId>>,
}

impl<K: Ord> Default for Acks<K> {
    fn default() -> Self {
        Acks {
            owed: BTreeMap::new(),
        }
    }
}

impl<K: Ord + Clone> Acks<K> {
    /// Waits for each of `workers` to acknowledge `key` (replacing any
    /// earlier wait for it).
    pub fn expect(&mut self, key: K, workers: impl IntoIterator<Item = WorkerId>) {
        self.owed.insert(key, workers.into_iter().collect());
    }

    /// `worker` acknowledged `key`: true when it was the last one owed (the
    /// key is then done and forgotten). An acknowledgement nobody waits
    /// for, or a second one, changes nothing.
    pub fn ack(&mut self, key: &K, worker: &str) -> bool {
        let Some(owed) = self.owed.get_mut(key) else {
            return false;
        };
        if !owed.remove(worker) || !owed.is_empty() {
            return false;
        }
        self.owed.remove(key);
        true
    }

    pub fn waits_for(&self, key: &K) -> bool {
        self.owed.contains_key(key)
    }

    /// Who still owes `key`, if it is waited for.
    pub fn owed(&self, key: &K) -> Option<&BTreeSet<WorkerId>> {
        self.owed.get(key)
    }

    /// Drops every wait that `worker` still owes an answer to (it was
    /// lost: those will never complete).
    pub fn drop_owed_by(&mut self, worker: &str) {
        self.owed.retain(|_, owed| !owed.contains(worker));
    }

    /// Keys still waited for.
    pub fn len(&self) -> usize {
        self.owed.len()
    }

    pub fn is_empty(&self) -> bool {
        self.owed.is_empty()
    }

    pub fn clear(&mut self) {
        self.owed.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_completes_at_its_last_owed_ack_once() {
        let mut a: Acks<u64> = Acks::default();
        a.expect(4, ["x".to_string(), "y".to_string()]);
        assert!(!a.ack(&4, "x"));
        assert!(!a.ack(&4, "x"), "a second ack is not another worker");
        assert!(!a.ack(&4, "z"), "nobody waits for z");
        assert!(!a.ack(&5, "y"), "nobody waits for 5");
        assert!(a.ack(&4, "y"), "the last one owed completes it");
        assert!(!a.waits_for(&4));
        assert!(!a.ack(&4, "y"), "and only once");
    }

    #[test]
    fn a_lost_worker_drops_only_what_it_still_owed() {
        let mut a: Acks<u64> = Acks::default();
        a.expect(1, ["x".to_string(), "y".to_string()]);
        a.expect(2, ["x".to_string(), "y".to_string()]);
        assert!(!a.ack(&1, "x"));
        a.drop_owed_by("x");
        assert!(a.waits_for(&1), "x answered 1 already");
        assert!(!a.waits_for(&2), "x still owed 2: it never completes");
        assert_eq!(a.len(), 1);
    }
}
