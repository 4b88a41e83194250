//! What the broker's handle sends the engine (one [`Command`] per request) and the replies held
//! until the flush that covers them decides whether they may be sent.

use tokio::sync::oneshot;

use crate::engine::WalkPos;
use crate::error::{Error, Result};
use crate::message::{
    Delivery, FlowConfig, HistoryEntry, MessageInfo, MessageState, Nacked, ProduceRequest, Produced,
    PushConfig, RescheduleRequest, Rescheduled, Stats, TopicInfo,
};
use crate::storage::writer::Release;

/// A pop's deliveries, and when flow control held one of its topics back, in how many ms asking
/// again may find room.
pub(super) type Popped = (Vec<Delivery>, Option<u64>);

/// A request for the engine, with the channel its answer goes back on.
pub(super) enum Command {
    Produce {
        topic: String,
        reqs: Vec<ProduceRequest>,
        reply: oneshot::Sender<Result<Vec<Result<Produced>>>>,
    },
    Pop {
        topics: Vec<String>,
        max: usize,
        ttr_ms: Option<u64>,
        reply: oneshot::Sender<Result<Popped>>,
    },
    Ack {
        receipt: String,
        reply: oneshot::Sender<Result<()>>,
    },
    AckId {
        id: String,
        reply: oneshot::Sender<Result<()>>,
    },
    Nack {
        receipt: String,
        delay_ms: Option<u64>,
        error: Option<String>,
        reply: oneshot::Sender<Result<Nacked>>,
    },
    Cancel {
        id: String,
        reply: oneshot::Sender<Result<()>>,
    },
    Touch {
        receipt: String,
        ttr_ms: u64,
        reply: oneshot::Sender<Result<u64>>,
    },
    Reschedule {
        id: String,
        req: RescheduleRequest,
        reply: oneshot::Sender<Result<Rescheduled>>,
    },
    Replace {
        topic: String,
        req: ProduceRequest,
        reply: oneshot::Sender<Result<()>>,
    },
    Get {
        id: String,
        reply: oneshot::Sender<Result<MessageInfo>>,
    },
    Stats {
        reply: oneshot::Sender<Result<Stats>>,
    },
    Pause {
        topic: String,
        paused: bool,
        reply: oneshot::Sender<Result<()>>,
    },
    Topics {
        reply: oneshot::Sender<Result<Vec<TopicInfo>>>,
    },
    SetPush {
        topic: String,
        cfg: Option<PushConfig>,
        reply: oneshot::Sender<Result<()>>,
    },
    SetFlow {
        topic: String,
        cfg: Option<FlowConfig>,
        reply: oneshot::Sender<Result<()>>,
    },
    GetFlow {
        topic: String,
        reply: oneshot::Sender<Result<Option<FlowConfig>>>,
    },
    GetPush {
        topic: String,
        reply: oneshot::Sender<Result<Option<PushConfig>>>,
    },
    Pushes {
        reply: oneshot::Sender<Result<(u64, Vec<PushConfig>)>>,
    },
    History {
        id: String,
        reply: oneshot::Sender<Result<(Vec<HistoryEntry>, bool)>>,
    },
    Browse {
        topic: String,
        state: MessageState,
        at: WalkPos,
        limit: usize,
        reply: oneshot::Sender<Result<(Vec<MessageInfo>, Option<WalkPos>)>>,
    },
    /// One slice of a purge (`ids` is `None`) or a redrive.
    Walk {
        op: WalkOp,
        topic: String,
        at: WalkPos,
        until: Option<u64>,
        reply: oneshot::Sender<Result<WalkStep>>,
    },
    /// The cut of a backup: answered at once, between two requests (see `storage::backup`).
    BackupCut {
        started: std::time::Instant,
        reply: oneshot::Sender<Result<crate::storage::backup::Cut>>,
    },
    Shutdown {
        reply: oneshot::Sender<Result<()>>,
    },
    /// Nothing to apply: the engine thread looks at its timers again.
    Wake,
}

impl Command {
    /// Answers a change with [`Error::Unavailable`] saying `why` instead of applying it (a
    /// cluster node that does not lead); gives back a read, which is applied as usual.
    pub(super) fn refuse_change(self, why: &str) -> Option<Command> {
        let err = || Error::Unavailable(why.to_string());
        match self {
            Command::Produce { reply, .. } => drop(reply.send(Err(err()))),
            Command::Pop { reply, .. } => drop(reply.send(Err(err()))),
            Command::Ack { reply, .. }
            | Command::AckId { reply, .. }
            | Command::Cancel { reply, .. }
            | Command::Replace { reply, .. }
            | Command::Pause { reply, .. }
            | Command::SetPush { reply, .. }
            | Command::SetFlow { reply, .. } => drop(reply.send(Err(err()))),
            Command::Nack { reply, .. } => drop(reply.send(Err(err()))),
            Command::Reschedule { reply, .. } => drop(reply.send(Err(err()))),
            Command::Touch { reply, .. } => drop(reply.send(Err(err()))),
            Command::Walk { reply, .. } => drop(reply.send(Err(err()))),
            read => return Some(read),
        }
        None
    }
}

/// What a purge or redrive slice does.
#[derive(Debug, Clone)]
pub(super) enum WalkOp {
    Purge,
    Redrive(Option<Vec<String>>),
}

/// One slice's result: messages changed, where to go on (`None`: done), and the log offset the
/// whole operation stops at (fixed by its first slice, so it never chases new messages).
pub(super) type WalkStep = (u64, Option<WalkPos>, u64);

/// A reply held until the batch's flush decides whether it may be sent.
pub(super) enum Pending {
    Produce(oneshot::Sender<Result<Vec<Result<Produced>>>>, Result<Vec<Result<Produced>>>),
    Pop(oneshot::Sender<Result<Popped>>, Result<Popped>),
    Unit(oneshot::Sender<Result<()>>, Result<()>),
    Nack(oneshot::Sender<Result<Nacked>>, Result<Nacked>),
    Reschedule(oneshot::Sender<Result<Rescheduled>>, Result<Rescheduled>),
    Touch(oneshot::Sender<Result<u64>>, Result<u64>),
    Walk(oneshot::Sender<Result<WalkStep>>, Result<WalkStep>),
}

impl Release for Pending {
    /// Sends the reply, or an `Unavailable` error instead when the flush covering it failed.
    fn release(self, flush_err: Option<&Error>) {
        match self {
            Pending::Produce(tx, r) => answer(tx, r, flush_err),
            Pending::Pop(tx, r) => answer(tx, r, flush_err),
            Pending::Unit(tx, r) => answer(tx, r, flush_err),
            Pending::Nack(tx, r) => answer(tx, r, flush_err),
            Pending::Reschedule(tx, r) => answer(tx, r, flush_err),
            Pending::Touch(tx, r) => answer(tx, r, flush_err),
            Pending::Walk(tx, r) => answer(tx, r, flush_err),
        }
    }
}

fn answer<T>(tx: oneshot::Sender<Result<T>>, r: Result<T>, flush_err: Option<&Error>) {
    let _ = tx.send(match flush_err {
        Some(Error::Unavailable(why)) => Err(Error::Unavailable(why.clone())),
        Some(e) => Err(Error::Unavailable(e.to_string())),
        None => r,
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_change_says_why_once_and_a_read_is_given_back() {
        let (reply, mut answer) = oneshot::channel();
        let produce = Command::Produce { topic: "t".into(), reqs: vec![], reply };
        assert!(produce.refuse_change("this node is not the cluster's leader").is_none());
        let e = answer.try_recv().expect("answered at once").expect_err("refused");
        assert_eq!(e.code(), "unavailable");
        assert_eq!(e.to_string(), "store unavailable: this node is not the cluster's leader");

        let (reply, mut answer) = oneshot::channel();
        let read = Command::Stats { reply }.refuse_change("not the leader");
        assert!(matches!(read, Some(Command::Stats { .. })), "a read is applied, not refused");
        assert!(answer.try_recv().is_err(), "nothing answered for the read yet");
    }
}
