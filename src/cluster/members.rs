//! Membership: which nodes vote, which only receive the log (learners), and where each is.
//!
//! A change (add a node, remove one) is a Raft entry like any other, proposed by the leader's
//! engine after the step's own records so the log stays in index order, and takes effect on each
//! node when that node applies it. A new node joins as a learner (it gets the log, by snapshot
//! when the leader no longer keeps its start) and the leader promotes it to voter once it has
//! caught up: one change at a time, so a majority of the old members always overlaps a majority
//! of the new ones. Each node keeps the members it last applied in `cluster/members`, which
//! replaces `peers` at its next start.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use protobuf::Message as _;
use raft::prelude::{ConfChangeSingle, ConfChangeType, ConfChangeV2, ConfState};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use crate::error::{Error, Result};

/// A membership change asked for through the API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Add node `id`, reachable at `addr`, as a learner (promoted once caught up).
    Add {
        /// The node's id.
        id: u64,
        /// Its cluster address.
        addr: String,
    },
    /// Make learner `id` a voter.
    Promote {
        /// The node's id.
        id: u64,
    },
    /// Remove node `id`.
    Remove {
        /// The node's id.
        id: u64,
    },
}

/// A change waiting to be proposed, and who waits for it to take effect.
pub struct Request {
    /// The change.
    pub change: Change,
    /// Answered once the change is applied here (or could not be proposed).
    pub reply: Option<oneshot::Sender<std::result::Result<(), String>>>,
}

impl Change {
    /// The change as raft-rs encodes it; a node's address travels in the context.
    pub fn encode(&self) -> ConfChangeV2 {
        let (kind, id, context) = match self {
            Change::Add { id, addr } => (ConfChangeType::AddLearnerNode, *id, addr.as_bytes().to_vec()),
            Change::Promote { id } => (ConfChangeType::AddNode, *id, Vec::new()),
            Change::Remove { id } => (ConfChangeType::RemoveNode, *id, Vec::new()),
        };
        let mut single = ConfChangeSingle::default();
        single.set_change_type(kind);
        single.set_node_id(id);
        let mut cc = ConfChangeV2::default();
        cc.set_changes(vec![single].into());
        cc.set_context(context.into());
        cc
    }

    /// Reads a change back from an entry's data.
    pub fn decode(data: &[u8]) -> Option<(ConfChangeV2, Change)> {
        let cc = ConfChangeV2::parse_from_bytes(data).ok()?;
        let single = cc.get_changes().first()?.clone();
        let id = single.node_id;
        let change = match single.get_change_type() {
            ConfChangeType::AddLearnerNode => {
                Change::Add { id, addr: String::from_utf8_lossy(cc.get_context()).into_owned() }
            }
            ConfChangeType::AddNode => Change::Promote { id },
            ConfChangeType::RemoveNode => Change::Remove { id },
        };
        Some((cc, change))
    }
}

/// The members a node last applied, kept across restarts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Members {
    /// Nodes that vote.
    pub voters: Vec<u64>,
    /// Nodes that receive the log but do not vote.
    pub learners: Vec<u64>,
    /// Every member's cluster address.
    pub addrs: BTreeMap<u64, String>,
}

impl Members {
    /// The members `peers` names: every one a voter.
    pub fn from_peers(peers: &[(u64, String)]) -> Members {
        Members {
            voters: peers.iter().map(|(id, _)| *id).collect(),
            learners: Vec::new(),
            addrs: peers.iter().cloned().collect(),
        }
    }

    /// Raft's configuration of these members.
    pub fn conf_state(&self) -> ConfState {
        ConfState::from((self.voters.clone(), self.learners.clone()))
    }

    /// Takes a configuration Raft applied, with `change`'s address for a node it added.
    pub fn apply(&mut self, cs: &ConfState, change: &Change) {
        self.voters = cs.get_voters().to_vec();
        self.learners = cs.get_learners().to_vec();
        match change {
            Change::Add { id, addr } => {
                self.addrs.insert(*id, addr.clone());
            }
            Change::Remove { id } => {
                self.addrs.remove(id);
            }
            Change::Promote { .. } => {}
        }
    }

    /// (id, address) of every member.
    pub fn peers(&self) -> Vec<(u64, String)> {
        self.addrs.iter().map(|(id, a)| (*id, a.clone())).collect()
    }

    fn path(dir: &Path) -> PathBuf {
        dir.join("cluster").join("members")
    }

    /// The members this node last applied, if it applied a change since it was made.
    pub fn load(dir: &Path) -> Result<Option<Members>> {
        let path = Members::path(dir);
        match std::fs::read(&path) {
            Ok(b) => serde_json::from_slice(&b).map(Some).map_err(|e| Error::Corrupt {
                file: path.display().to_string(),
                offset: 0,
                reason: format!("not a members file: {e}"),
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::io_at("read", &path, e)),
        }
    }

    /// Writes these members durably (atomic replace).
    pub fn save(&self, dir: &Path) -> Result<()> {
        let path = Members::path(dir);
        let bytes = serde_json::to_vec_pretty(self).map_err(|e| Error::Config(e.to_string()))?;
        super::persist::write_durably(&path, &bytes).map_err(|e| Error::io_at("write", &path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_round_trip_through_their_encoding() {
        for change in [
            Change::Add { id: 4, addr: "10.0.0.4:9278".into() },
            Change::Promote { id: 4 },
            Change::Remove { id: 2 },
        ] {
            let bytes = change.encode().write_to_bytes().unwrap();
            assert_eq!(Change::decode(&bytes).map(|(_, c)| c), Some(change));
        }
        assert_eq!(Change::decode(b"\xff\xff\xff"), None);
    }

    #[test]
    fn members_follow_the_configuration_and_keep_addresses() {
        let mut m = Members::from_peers(&[(1, "a:1".into()), (2, "b:1".into()), (3, "c:1".into())]);
        let cs = ConfState::from((vec![1, 2, 3], vec![4]));
        m.apply(&cs, &Change::Add { id: 4, addr: "d:1".into() });
        assert_eq!((m.voters.clone(), m.learners.clone()), (vec![1, 2, 3], vec![4]));
        assert_eq!(m.addrs.get(&4).map(String::as_str), Some("d:1"));
        m.apply(&ConfState::from((vec![1, 3, 4], vec![])), &Change::Remove { id: 2 });
        assert_eq!(m.peers().iter().map(|(id, _)| *id).collect::<Vec<_>>(), vec![1, 3, 4]);
        let dir = tempfile::tempdir().unwrap();
        m.save(dir.path()).unwrap();
        assert_eq!(Members::load(dir.path()).unwrap(), Some(m));
    }
}
