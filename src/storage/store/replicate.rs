//! The store's half of replication (see `storage::replica`): every commit first appends the
//! consensus log's entries this log lacks, then proposes this step's own records as one entry and
//! appends its mark.

use super::Store;
use crate::error::{Error, Result};
use crate::storage::format::{self, EntryKind, RaftMark, Record};
use crate::storage::replica::{Diverged, ReplicaEntry, Replicator, Sealed};

impl Store {
    /// Makes this store a cluster node's: `sealed` is its log's last entry (found before it
    /// opened).
    pub fn set_replicator(&mut self, replica: Box<dyn Replicator>, sealed: Sealed) {
        self.replica = Some(replica);
        self.sealed = sealed;
    }

    /// True when this node may append records of its own: always on a single node; in a
    /// cluster, only while it leads.
    pub fn may_act(&self) -> bool {
        self.replica.as_ref().is_none_or(|r| r.leading())
    }

    /// Log offset up to which this log's entries are committed (durable on a majority, never
    /// undone); the whole log on a single node.
    pub fn committed_end(&self) -> u64 {
        self.replica.as_ref().map_or(u64::MAX, |r| r.committed_end())
    }

    /// True in a cluster.
    pub fn replicated(&self) -> bool {
        self.replica.is_some()
    }

    /// Keeps the log framed as the replicated log before a commit (see the module
    /// documentation). An error answers the step's requests with it.
    pub(super) fn seal(&mut self) -> Result<()> {
        let Some(mut rep) = self.replica.take() else { return Ok(()) };
        let r = self.seal_with(rep.as_mut());
        self.replica = Some(rep);
        r
    }

    fn seal_with(&mut self, rep: &mut dyn Replicator) -> Result<()> {
        let unsealed = self.log.end() > self.sealed.end;
        let missing = match rep.missing(self.sealed) {
            Ok(m) => m,
            Err(d) => return Err(diverged(rep, d)),
        };
        if unsealed && !missing.is_empty() {
            let why = "records were applied here while the leader's entries arrived";
            return Err(diverged(rep, Diverged { keep: self.sealed.index, why }));
        }
        for e in &missing {
            self.append_entry(rep, e)?;
        }
        if unsealed {
            let data_start = self.sealed.end;
            let records = self.records_between(data_start, self.log.end())?;
            let Some((term, index)) = rep.propose(records, data_start) else {
                let why = "leadership was lost before this step's records were proposed";
                return Err(diverged(rep, Diverged { keep: self.sealed.index, why }));
            };
            self.append_mark(rep, RaftMark { term, index, kind: EntryKind::Normal, data_start, payload: &[] })?;
        }
        for e in rep.membership() {
            let data_start = self.log.end();
            self.append_mark(rep, RaftMark { term: e.term, index: e.index, kind: e.kind, data_start, payload: &e.payload })?;
        }
        Ok(())
    }

    /// Appends a replicated entry: each record, dispatched as if this node had written it, then
    /// its mark.
    fn append_entry(&mut self, rep: &mut dyn Replicator, e: &ReplicaEntry) -> Result<()> {
        let data_start = self.log.end();
        if let Some(origin) = e.origin_start.filter(|o| *o != data_start) {
            let why = format!(
                "entry {} starts at log offset {origin} on the leader but would start at {data_start} here: \
                 every node must have the same segment_bytes (records refer to each other by offset)",
                e.index
            );
            rep.refuse(&why);
            return Err(Error::Config(why));
        }
        let mut at = 0;
        while at < e.records.len() {
            let bytes = &e.records[at..];
            let (rec, len) = format::decode(bytes).map_err(|err| Error::Corrupt {
                file: "replicated entry".into(),
                offset: e.index,
                reason: format!("record {at} of the entry does not decode: {err:?}"),
            })?;
            self.append_framed(&bytes[..len], &rec)?;
            at += len;
        }
        let mark = RaftMark { term: e.term, index: e.index, kind: e.kind, data_start, payload: &e.payload };
        self.append_mark(rep, mark)
    }

    fn append_mark(&mut self, rep: &mut dyn Replicator, mark: RaftMark<'_>) -> Result<()> {
        let (term, index) = (mark.term, mark.index);
        self.append(&Record::Raft(mark))?;
        self.sealed = Sealed { index, term, end: self.log.end() };
        rep.sealed(self.sealed);
        Ok(())
    }

    /// The records appended in `[from, to)`, framed, back to back (end-of-segment markers left
    /// out: a node places records in segments itself).
    fn records_between(&self, from: u64, to: u64) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        let mut at = from;
        while at < to {
            let Some((offset, _, next)) = self.log.next_fields(at)? else { break };
            if let Some(raw) = self.log.raw(offset, (next - offset) as usize) {
                out.extend_from_slice(raw);
            }
            at = next;
        }
        Ok(out)
    }
}

/// Reports a divergence to the cluster (which cuts the log back and rejoins) and the error the
/// step's requests get.
fn diverged(rep: &mut dyn Replicator, d: Diverged) -> Error {
    rep.diverged(d);
    Error::Unavailable(format!("this node's log diverged from the leader's ({}); it is rejoining: retry", d.why))
}
