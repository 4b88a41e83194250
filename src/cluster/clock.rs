//! Clock offsets between cluster nodes, measured NTP-style over the node-to-node link, and the two
//! decisions they feed: whether this node may lead ([`ClockView::may_lead`]) and the clock a
//! leader fires due messages by ([`ClockView::fire_clock`]).
//!
//! Pure logic: no I/O, no tasks, no clock reads. The caller stamps probes with the wall clock
//! (unix µs) and measures round trips and ages with a monotonic clock, and passes both in.
//!
//! # The measurement
//!
//! This node (A) sends a probe at its wall time `t0`; the peer (B) stamps its wall time `t1` when
//! the probe arrives and `t2` when it sends the reply; A reads its wall time `t3` when the reply
//! arrives, and the round trip `rtt_us` on its monotonic clock (send to receive, B's turnaround
//! included). B's offset relative to A (how far B's clock reads ahead of A's) is estimated as
//! `((t1 - t0) + (t2 - t3)) / 2`. The estimate is off by half the difference of the two one-way
//! delays, which, since neither delay is negative, is at most `rtt / 2`: a hard bound, whatever
//! the network does, not a statistical one. [`Sample::error_us`] adds the microsecond granularity
//! of the four stamps and of `rtt_us` to it.
//!
//! [`PeerClock`] keeps a peer's last few samples and answers with the one whose bound is tightest
//! (NTP's clock filter: the smallest round trip is the least asymmetric one), its bound widened by
//! the drift the two clocks may have had since ([`FilterConfig::drift_ppm`]); samples older than
//! [`FilterConfig::stale_after_us`] are not used at all.
//!
//! # What still bounds earliness
//!
//! A leader fires a message when [`ClockView::fire_clock`] has passed its due time. At that
//! moment every peer with a fresh estimate reads at least the due time, and so does this node,
//! unless one of these happened:
//! - A clock ran faster, relative to the other, than `drift_ppm` since its last sample, or was
//!   stepped forward (by hand, by a VM resume, by an NTP step) since then: seen at the next probe,
//!   so this is bounded by the probe interval times the step. A step of *this* node's wall clock
//!   does not count: peers' clocks are extrapolated on the monotonic clock, not on the wall clock.
//! - A peer has no fresh estimate (no probe answered within `stale_after_us`, e.g. just after an
//!   election or through a partition): it is not considered, and may read earlier than the leader.
//!   A caller that wants every voter covered checks [`ClockView::fresh_peers`] first.
//!
//! The due time itself was stamped by whichever leader accepted the write, on its own clock.
//! A leader that read behind the cluster stamped due times early by its lag; [`ClockView::may_lead`]
//! refuses a node that is behind the cluster's majority by more than `max_clock_skew` as well as
//! one ahead of it, so that lag is at most `max_clock_skew` plus its estimate error. Finally the
//! client's clock is invisible to delayd: "never early by the client's clock" holds to the extent
//! the client's clock agrees with the majority of the nodes.
//!
//! The error bound, the drift allowance and a slow peer only ever make firing *later*: the cost of
//! all this is lateness, up to the slowest fresh peer's lag plus twice its error.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;

/// One probe exchange with a peer, as this node recorded it (wall times in unix µs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// This node's wall time when it sent the probe.
    pub t0: i64,
    /// The peer's wall time when the probe arrived.
    pub t1: i64,
    /// The peer's wall time when it sent the reply.
    pub t2: i64,
    /// This node's wall time when the reply arrived.
    pub t3: i64,
    /// Send to receive on this node's monotonic clock, the peer's turnaround included.
    pub rtt_us: u64,
}

/// `t3` and the monotonic time elapsed since are both truncated readings; their sum overstates
/// this node's clock by under 1 µs.
const ANCHOR_SLACK_US: i128 = 1;

/// Slack for comparing two microsecond readings of the same interval on two clocks: each
/// difference of truncated stamps is off by less than 1 µs.
const STAMP_SLACK_US: i128 = 2;

/// How far this node's wall and monotonic readings of a probe's round trip may disagree before
/// the sample is taken for a stepped clock. They are read one after the other, and a thread
/// preempted between the two (any busy machine) makes them disagree by microseconds to
/// milliseconds: with 2 µs here, a node under load refused nearly every sample, and one far
/// ahead was never found out. The disagreement is added to the sample's error bound instead
/// (see [`Sample::error_us`]), so what this lets through only widens the bound.
const LOCAL_STEP_SLACK_US: i128 = 500;

impl Sample {
    /// Refuses a sample whose stamps contradict each other, which only a clock stepped during the
    /// probe (or a peer misreporting) produces; its offset would be wrong by the step.
    pub fn check(&self) -> Result<(), SampleError> {
        let (t0, t1, t2, t3) = (self.t0 as i128, self.t1 as i128, self.t2 as i128, self.t3 as i128);
        let rtt = self.rtt_us as i128;
        if t3 < t0 || (t3 - t0 - rtt).abs() > LOCAL_STEP_SLACK_US {
            return Err(SampleError::LocalClockStepped { wall_us: t3 - t0, rtt_us: self.rtt_us });
        }
        // The turnaround is inside the round trip: longer (or negative) means the peer's clock
        // moved between its two stamps.
        if t2 < t1 || t2 - t1 > rtt + STAMP_SLACK_US {
            return Err(SampleError::PeerClockStepped { turnaround_us: t2 - t1, rtt_us: self.rtt_us });
        }
        Ok(())
    }

    /// How far the peer's clock reads ahead of this node's (negative: behind), in µs.
    pub fn offset_us(&self) -> i64 {
        let (t0, t1, t2, t3) = (self.t0 as i128, self.t1 as i128, self.t2 as i128, self.t3 as i128);
        saturate(((t1 - t0) + (t2 - t3)).div_euclid(2))
    }

    /// The most [`Sample::offset_us`] can be off by: half the round trip (the worst asymmetry of
    /// the two one-way delays), plus the stamps' millisecond truncation, plus half of any
    /// disagreement between this node's wall and monotonic readings of the round trip (a step
    /// of the wall clock that small, or the time between reading the two, shifts the estimate
    /// by at most that much). Derivation: the real round trip is under `rtt_us + 1`; the two
    /// stamp differences are each off by under 1 µs, so their half-sum by under 1; the halving
    /// rounds by at most 0.5.
    pub fn error_us(&self) -> u64 {
        let disagree = (self.t3 as i128 - self.t0 as i128 - self.rtt_us as i128).unsigned_abs();
        let disagree = u64::try_from(disagree.div_ceil(2)).unwrap_or(u64::MAX);
        self.rtt_us.saturating_add(1).div_ceil(2).saturating_add(2).saturating_add(disagree)
    }
}

/// Why a sample was not used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SampleError {
    /// This node's wall clock disagrees with its monotonic clock about the round trip.
    LocalClockStepped {
        /// `t3 - t0`.
        wall_us: i128,
        /// The monotonic round trip.
        rtt_us: u64,
    },
    /// The peer's turnaround is negative or longer than the whole round trip.
    PeerClockStepped {
        /// `t2 - t1`.
        turnaround_us: i128,
        /// The monotonic round trip.
        rtt_us: u64,
    },
    /// A sample for a node that is not one of this view's peers.
    UnknownPeer(u64),
}

impl fmt::Display for SampleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SampleError::LocalClockStepped { wall_us, rtt_us } => write!(
                f,
                "clock probe dropped: this node's wall clock measured the round trip as {wall_us} µs, \
                 its monotonic clock as {rtt_us} µs (the wall clock was stepped)"
            ),
            SampleError::PeerClockStepped { turnaround_us, rtt_us } => write!(
                f,
                "clock probe dropped: the peer's turnaround of {turnaround_us} µs does not fit in the \
                 {rtt_us} µs round trip (its clock was stepped)"
            ),
            SampleError::UnknownPeer(id) => write!(f, "clock probe dropped: node {id} is not a peer"),
        }
    }
}

impl std::error::Error for SampleError {}

/// How samples are kept and aged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FilterConfig {
    /// Samples kept per peer (NTP keeps 8).
    pub samples: usize,
    /// Samples older than this (monotonic µs) are not used.
    pub stale_after_us: u64,
    /// The largest rate difference assumed between a peer's wall clock and this node's monotonic
    /// clock, in parts per million; an estimate's error grows by this much of its age. 500 ppm
    /// is the most a kernel's NTP discipline will slew; unsynchronised quartz is usually under 100.
    pub drift_ppm: u64,
}

impl Default for FilterConfig {
    fn default() -> FilterConfig {
        // 10 s of age adds at most 5 ms of drift allowance.
        FilterConfig { samples: 8, stale_after_us: 10_000_000, drift_ppm: 500 }
    }
}

/// A peer's clock as estimated from one sample, aged to a given moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Offset {
    /// How far the peer's clock reads ahead of this node's (negative: behind), in µs.
    pub offset_us: i64,
    /// The most `offset_us` can be off by now: the sample's bound plus drift since it was taken.
    pub error_us: u64,
    /// This node's monotonic time when the sample's reply arrived.
    pub at_mono_us: u64,
    /// This node's wall time then (`t3`), with `at_mono_us` the anchor for extrapolating the
    /// peer's clock on the monotonic clock.
    pub local_us: i64,
}

impl Offset {
    /// At least this far ahead of the peer this node's clock is (negative: it may be behind).
    pub fn surely_ahead_us(&self) -> i64 {
        saturate(-(self.offset_us as i128) - self.error_us as i128)
    }

    /// At least this far behind the peer this node's clock is (negative: it may be ahead).
    pub fn surely_behind_us(&self) -> i64 {
        saturate(self.offset_us as i128 - self.error_us as i128)
    }

    /// The earliest the peer's wall clock can read at monotonic time `now_mono_us`: extrapolated
    /// from `t3` on the monotonic clock, less the error bound, less ANCHOR_SLACK_US.
    fn peer_now_floor(&self, now_mono_us: u64) -> i64 {
        let elapsed = now_mono_us.saturating_sub(self.at_mono_us) as i128;
        let floor = self.local_us as i128 + elapsed + self.offset_us as i128 - self.error_us as i128;
        saturate(floor - ANCHOR_SLACK_US)
    }
}

/// One peer's recent samples and the estimate they give.
#[derive(Debug, Clone)]
pub struct PeerClock {
    config: FilterConfig,
    /// Oldest first, each with this node's monotonic time at `t3`.
    samples: VecDeque<(Sample, u64)>,
}

impl PeerClock {
    /// A peer with no samples yet.
    pub fn new(config: FilterConfig) -> PeerClock {
        PeerClock { config, samples: VecDeque::with_capacity(config.samples.max(1)) }
    }

    /// Keeps a checked sample whose reply arrived at monotonic time `at_mono_us` (read with `t3`),
    /// dropping the oldest beyond [`FilterConfig::samples`].
    pub fn record(&mut self, sample: Sample, at_mono_us: u64) -> Result<(), SampleError> {
        sample.check()?;
        while self.samples.len() >= self.config.samples.max(1) {
            self.samples.pop_front();
        }
        self.samples.push_back((sample, at_mono_us));
        Ok(())
    }

    /// The estimate at monotonic time `now_mono_us`: of the samples not older than
    /// `stale_after_us`, the one with the tightest bound once aged (the smallest round trip, a
    /// newer one winning a tie); None without a fresh sample.
    pub fn estimate(&self, now_mono_us: u64) -> Option<Offset> {
        self.samples
            .iter()
            .filter_map(|&(s, at)| {
                let age = now_mono_us.saturating_sub(at);
                (age <= self.config.stale_after_us).then(|| {
                    let drift = (age as u128 * self.config.drift_ppm as u128).div_ceil(1_000_000);
                    let error_us = s.error_us().saturating_add(u64::try_from(drift).unwrap_or(u64::MAX));
                    Offset { offset_us: s.offset_us(), error_us, at_mono_us: at, local_us: s.t3 }
                })
            })
            .min_by_key(|o| (o.error_us, std::cmp::Reverse(o.at_mono_us)))
    }
}

/// Which way a node's clock is off from its cluster's majority.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// It reads later than the majority: as leader it would fire early.
    Ahead,
    /// It reads earlier: as leader it would stamp due times early, which the next leader honours.
    Behind,
}

/// One peer's part in a [`SkewReport`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerSkew {
    /// The peer's node id.
    pub node_id: u64,
    /// How far this node's clock reads ahead of the peer's, as measured (negative: behind).
    pub ahead_us: i64,
    /// The measurement's error bound.
    pub error_us: u64,
}

/// Why this node may not lead: how far off the majority its clock is, and each peer's measurement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkewReport {
    /// Ahead of or behind the majority.
    pub direction: Direction,
    /// By at least this much (error bounds taken in this node's favour).
    pub by_us: i64,
    /// The configured limit it exceeds.
    pub max_skew_ms: u64,
    /// Every peer with a fresh estimate, by node id.
    pub peers: Vec<PeerSkew>,
}

impl fmt::Display for SkewReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let way = match self.direction {
            Direction::Ahead => "ahead of",
            Direction::Behind => "behind",
        };
        write!(
            f,
            "this node's clock is at least {} ms {way} a majority of the cluster, more than \
             max_clock_skew ({} ms), so it does not lead; measured:",
            self.by_us / 1000,
            self.max_skew_ms
        )?;
        for (i, p) in self.peers.iter().enumerate() {
            let sep = if i == 0 { " " } else { ", " };
            let (n, way) = if p.ahead_us >= 0 { (p.ahead_us, "ahead of") } else { (-p.ahead_us, "behind") };
            // Whole ms, the bound rounded up: a report a person reads, not the rule itself.
            write!(f, "{sep}{} ms (± {} ms) {way} node {}", n / 1000, p.error_us.div_ceil(1000), p.node_id)?;
        }
        Ok(())
    }
}

/// This node's view of every peer's clock: whether it may lead, and the clock it fires by.
#[derive(Debug, Clone)]
pub struct ClockView {
    config: FilterConfig,
    peers: BTreeMap<u64, PeerClock>,
}

impl ClockView {
    /// A view over `peers` (the other voters' node ids, not this node's); none is a single node.
    pub fn new(peers: impl IntoIterator<Item = u64>, config: FilterConfig) -> ClockView {
        let peers = peers.into_iter().map(|id| (id, PeerClock::new(config))).collect();
        ClockView { config, peers }
    }

    /// After a membership change: new peers start empty, removed ones are forgotten, the others
    /// keep their samples.
    pub fn set_peers(&mut self, peers: impl IntoIterator<Item = u64>) {
        let mut old = std::mem::take(&mut self.peers);
        self.peers = peers
            .into_iter()
            .map(|id| (id, old.remove(&id).unwrap_or_else(|| PeerClock::new(self.config))))
            .collect();
    }

    /// Records a probe of peer `node_id` whose reply arrived at monotonic time `at_mono_us`.
    pub fn record(&mut self, node_id: u64, sample: Sample, at_mono_us: u64) -> Result<(), SampleError> {
        self.peers.get_mut(&node_id).ok_or(SampleError::UnknownPeer(node_id))?.record(sample, at_mono_us)
    }

    /// Each peer's current estimate, by node id; peers without a fresh sample are left out.
    pub fn estimates(&self, now_mono_us: u64) -> Vec<(u64, Offset)> {
        self.peers.iter().filter_map(|(&id, p)| p.estimate(now_mono_us).map(|o| (id, o))).collect()
    }

    /// How many peers have a fresh estimate.
    pub fn fresh_peers(&self, now_mono_us: u64) -> usize {
        self.estimates(now_mono_us).len()
    }

    /// How far this node's clock is, at least, ahead of the cluster: the largest `x` such that a
    /// majority of the voters (this node included, `(peers + 1) / 2 + 1` of them) surely read at
    /// least `x` earlier than this node, each peer's error bound taken in this node's favour
    /// (`-offset - error`); never below 0. None when no peer has a fresh estimate (a single node,
    /// or before the first probe).
    ///
    /// A majority, not the slowest peer: with one peer 2 s behind and the other in step, the
    /// outlier is the slow peer, and this node is 0 ahead. Taking the slowest peer instead would
    /// keep every correct node from leading and leave only the slow one, whose early due-time
    /// stamps are exactly what must not happen. Peers without an estimate count as not behind:
    /// leading is refused on evidence only, so an election is never blocked waiting for probes
    /// (firing stays corrected by [`ClockView::fire_clock`] meanwhile).
    pub fn ahead_of_others_us(&self, now_mono_us: u64) -> Option<i64> {
        self.majority_bound(now_mono_us, Offset::surely_ahead_us)
    }

    /// The mirror of [`ClockView::ahead_of_others_us`]: how far this node's clock is, at least,
    /// behind a majority of the voters (`offset - error` per peer); never below 0.
    pub fn behind_others_us(&self, now_mono_us: u64) -> Option<i64> {
        self.majority_bound(now_mono_us, Offset::surely_behind_us)
    }

    /// The majority-th largest of `bound` over the voters, this node counting as 0 and peers
    /// without an estimate as unknown (never counted towards the majority); clamped at 0.
    fn majority_bound(&self, now_mono_us: u64, bound: fn(&Offset) -> i64) -> Option<i64> {
        let estimates = self.estimates(now_mono_us);
        if estimates.is_empty() {
            return None;
        }
        let voters = self.peers.len() + 1;
        let majority = voters / 2 + 1;
        let mut bounds: Vec<i64> = estimates.iter().map(|(_, o)| bound(o)).collect();
        bounds.push(0);
        bounds.sort_unstable_by(|a, b| b.cmp(a));
        Some(bounds.get(majority - 1).copied().unwrap_or(0).max(0))
    }

    /// Whether this node may become or stay leader: refused when its clock is surely more than
    /// `max_skew_ms` ahead of, or behind, a majority of the voters (see
    /// [`ClockView::ahead_of_others_us`]). Allowed without any estimate (a single node, or no
    /// probe answered yet): refusing there would leave a cluster unable to elect before its
    /// probes run, and a leader's firing is corrected by [`ClockView::fire_clock`] anyway.
    ///
    /// Error bounds are taken in the node's favour, so a node is refused on proof; a node within
    /// `max_skew_ms` plus its estimate error may lead. A two-node cluster never has a majority
    /// against one node: its clocks are never grounds to refuse.
    pub fn may_lead(&self, max_skew_ms: u64, now_mono_us: u64) -> Result<(), SkewReport> {
        let limit = i64::try_from(max_skew_ms.saturating_mul(1000)).unwrap_or(i64::MAX);
        let ahead = self.ahead_of_others_us(now_mono_us).unwrap_or(0);
        let behind = self.behind_others_us(now_mono_us).unwrap_or(0);
        let (direction, by_us) = match (ahead > limit, behind > limit) {
            (true, _) => (Direction::Ahead, ahead),
            (false, true) => (Direction::Behind, behind),
            (false, false) => return Ok(()),
        };
        let peers = self
            .estimates(now_mono_us)
            .into_iter()
            .map(|(node_id, o)| PeerSkew {
                node_id,
                ahead_us: saturate(-(o.offset_us as i128)),
                error_us: o.error_us,
            })
            .collect();
        Err(SkewReport { direction, by_us, max_skew_ms, peers })
    }

    /// The clock a majority agrees has passed: the latest time that this node's clock
    /// (`local_now_us`) and, of a cluster of `voters` (this node included), a majority's clocks
    /// surely read, peers taken at their floor. One outlier, fast or slow, moves it neither way;
    /// never later than `local_now_us`. With fresh estimates from fewer peers than a majority
    /// needs it is [`ClockView::fire_clock`], the slowest of those known.
    pub fn majority_clock(&self, local_now_us: i64, now_mono_us: u64, voters: usize) -> i64 {
        let mut readings: Vec<i64> =
            self.estimates(now_mono_us).iter().map(|(_, o)| o.peer_now_floor(now_mono_us)).collect();
        readings.push(local_now_us);
        let majority = voters / 2 + 1;
        if readings.len() < majority {
            return self.fire_clock(local_now_us, now_mono_us);
        }
        // The majority-th largest reading: that many clocks read at least it.
        readings.sort_unstable_by(|a, b| b.cmp(a));
        readings[majority - 1].min(local_now_us)
    }

    /// The clock a leader fires by: `local_now_us` (this node's wall clock, unix µs, read at
    /// monotonic time `now_mono_us`) moved back by how far this node is ahead of the slowest peer
    /// with a fresh estimate, that peer's error bound added; never later than `local_now_us`.
    ///
    /// Each peer's clock is extrapolated from its sample on the monotonic clock, so a forward step
    /// of this node's wall clock since the samples does not bring firing forward; a backward one
    /// delays it, through `local_now_us`. Peers without a fresh estimate are not considered (see
    /// the module's notes on what still bounds earliness).
    pub fn fire_clock(&self, local_now_us: i64, now_mono_us: u64) -> i64 {
        self.estimates(now_mono_us)
            .iter()
            .map(|(_, o)| o.peer_now_floor(now_mono_us))
            .fold(local_now_us, i64::min)
    }
}

/// An i128 intermediate back to i64, pinned at the ends: stamps come from the network and may be
/// anything, and a wrong sign would be worse than a pinned value.
fn saturate(v: i128) -> i64 {
    i64::try_from(v).unwrap_or(if v < 0 { i64::MIN } else { i64::MAX })
}

#[cfg(test)]
mod tests {
    //! The module works in µs, and most tests here are unit-free: their numbers keep their
    //! relations at any unit, so they read as the ms they were written in. `three_ms` and the
    //! staleness test use real µs (the default filter's age limit and `may_lead`'s ms limit are
    //! absolute).
    use super::*;
    use proptest::prelude::*;

    /// A probe of a peer whose clock reads `offset` µs ahead of ours, sent at our wall time `t0`,
    /// with one-way delays `d1` (there) and `d2` (back) and a turnaround of `turn` µs.
    fn probe(t0: i64, offset: i64, d1: i64, turn: i64, d2: i64) -> Sample {
        let t1 = t0 + d1 + offset;
        let t2 = t1 + turn;
        let t3 = t0 + d1 + turn + d2;
        Sample { t0, t1, t2, t3, rtt_us: (d1 + turn + d2) as u64 }
    }

    const NOW: i64 = 1_796_115_600_000;

    /// A three-node view (peers 2 and 3) with one sample each, whose reply arrived at our wall
    /// time NOW and monotonic time 1000, where the peers read `o2` and `o3` ms ahead of us
    /// (negative: behind) over a 10 ms symmetric path: each known to ±8 ms.
    fn three(o2: i64, o3: i64) -> ClockView {
        let mut v = ClockView::new([2, 3], FilterConfig::default());
        v.record(2, probe(NOW - 10, o2, 5, 0, 5), 1_000).unwrap();
        v.record(3, probe(NOW - 10, o3, 5, 0, 5), 1_000).unwrap();
        v
    }

    #[test]
    fn symmetric_delays_give_the_exact_offset() {
        for offset in [-2_000, -1, 0, 1, 250, 3_600_000] {
            let s = probe(NOW, offset, 40, 3, 40);
            assert_eq!(s.check(), Ok(()));
            assert_eq!(s.offset_us(), offset);
            assert_eq!(s.error_us(), 42 + 2, "half of the 83 ms round trip, rounded up, plus stamp slack");
        }
    }

    #[test]
    fn asymmetric_delays_stay_within_the_bound() {
        // All the delay on one leg: the worst case, off by half the round trip.
        for (d1, d2) in [(100, 0), (0, 100), (90, 10), (1, 99)] {
            let s = probe(NOW, 500, d1, 2, d2);
            let off_by = (s.offset_us() - 500).unsigned_abs();
            assert!(off_by <= s.error_us(), "{d1}/{d2}: off by {off_by}, bound {}", s.error_us());
        }
        assert_eq!(probe(NOW, 500, 100, 0, 0).offset_us(), 550);
    }

    #[test]
    fn the_filter_picks_the_smallest_round_trip() {
        let mut p = PeerClock::new(FilterConfig::default());
        // The true offset is 300; the slow probes are lopsided and wrong by up to 100 ms.
        p.record(probe(NOW, 300, 200, 0, 20), 1_000).unwrap();
        p.record(probe(NOW + 10, 300, 3, 0, 1), 1_100).unwrap();
        p.record(probe(NOW + 20, 300, 10, 0, 90), 1_200).unwrap();
        let e = p.estimate(1_200).unwrap();
        assert_eq!((e.offset_us, e.at_mono_us), (301, 1_100));
        // The 4 ms round trip's bound, plus 100 ms at 500 ppm of drift (rounded up to 1 ms).
        assert_eq!(e.error_us, 3 + 2 + 1);
    }

    #[test]
    fn only_the_last_samples_are_kept() {
        let mut p = PeerClock::new(FilterConfig { samples: 2, ..FilterConfig::default() });
        p.record(probe(NOW, 7, 1, 0, 1), 1_000).unwrap();
        p.record(probe(NOW, 8, 50, 0, 50), 1_001).unwrap();
        p.record(probe(NOW, 9, 40, 0, 40), 1_002).unwrap();
        // The tight first sample was pushed out by the two after it.
        assert_eq!(p.estimate(1_002).unwrap().offset_us, 9);
    }

    #[test]
    fn stale_samples_are_ignored_and_age_widens_the_bound() {
        let cfg = FilterConfig::default();
        let mut p = PeerClock::new(cfg);
        p.record(probe(NOW, -40_000, 1_000, 0, 1_000), 1_000_000).unwrap();
        p.record(probe(NOW, -45_000, 30_000, 0, 30_000), 5_000_000).unwrap();
        // At 6 s both are fresh; the tight old one still wins.
        assert_eq!(p.estimate(6_000_000).unwrap().offset_us, -40_000);
        // Past 11 s the first is stale: the second answers, its bound widened by 6 s of drift.
        let e = p.estimate(1_000_000 + cfg.stale_after_us + 1).unwrap();
        // The 60 ms round trip gives 30,001 + 2 µs; 6.000001 s at 500 ppm adds 3,000.0005,
        // rounded up.
        assert_eq!((e.offset_us, e.error_us), (-45_000, 30_001 + 2 + 3_001));
        assert_eq!(p.estimate(5_000_000 + cfg.stale_after_us + 1), None);
    }

    /// Wall and monotonic readings that disagree by less than a step (a thread preempted between
    /// reading them) keep the sample, with the disagreement in its bound.
    #[test]
    fn a_small_disagreement_is_kept_and_widens_the_bound() {
        let s = probe(NOW, 0, 10, 1, 10);
        let mut late = s;
        late.t3 += 300;
        assert!(late.check().is_ok());
        assert_eq!(late.error_us(), s.error_us() + 150);
        assert!((late.offset_us() - s.offset_us()).unsigned_abs() <= late.error_us() - s.error_us());
    }

    #[test]
    fn stepped_clocks_are_refused() {
        let mut s = probe(NOW, 0, 10, 1, 10);
        s.t3 += 1_000; // our wall clock jumped while the probe was out
        assert!(matches!(s.check(), Err(SampleError::LocalClockStepped { .. })));
        let mut s = probe(NOW, 0, 10, 1, 10);
        s.t2 -= 5; // the peer's clock went back between its stamps
        assert!(matches!(s.check(), Err(SampleError::PeerClockStepped { .. })));
        let mut s = probe(NOW, 0, 10, 1, 10);
        s.t2 += 100;
        assert!(matches!(s.check(), Err(SampleError::PeerClockStepped { .. })));
        let mut v = ClockView::new([2], FilterConfig::default());
        assert_eq!(v.record(9, probe(NOW, 0, 1, 0, 1), 0), Err(SampleError::UnknownPeer(9)));
        assert!(v.record(2, s, 0).is_err());
        assert_eq!(v.fresh_peers(0), 0);
    }

    #[test]
    fn extreme_stamps_do_not_overflow() {
        let s = Sample { t0: i64::MIN, t1: i64::MAX, t2: i64::MAX, t3: i64::MIN, rtt_us: 0 };
        assert_eq!(s.offset_us(), i64::MAX);
        assert_eq!(Sample { t0: 0, t1: 0, t2: 0, t3: 0, rtt_us: u64::MAX }.error_us(), u64::MAX);
        assert!(Sample { t0: i64::MAX, t1: 0, t2: 0, t3: i64::MIN, rtt_us: u64::MAX }.check().is_err());
    }

    /// Like [`three`], at the scale a cluster measures: the peers read `o2_ms` and `o3_ms` ms
    /// ahead over a 10 ms symmetric path, known to ±5,003 µs; replies at monotonic 1 s.
    fn three_ms(o2_ms: i64, o3_ms: i64) -> ClockView {
        let mut v = ClockView::new([2, 3], FilterConfig::default());
        v.record(2, probe(NOW - 10_000, o2_ms * 1000, 5_000, 0, 5_000), 1_000_000).unwrap();
        v.record(3, probe(NOW - 10_000, o3_ms * 1000, 5_000, 0, 5_000), 1_000_000).unwrap();
        v
    }

    #[test]
    fn a_node_2s_ahead_may_not_lead_200ms_ahead_may() {
        // Both peers read 2 s behind us: we are the one ahead.
        let v = three_ms(-2_000, -2_000);
        let report = v.may_lead(250, 1_000_000).unwrap_err();
        assert_eq!((report.direction, report.by_us), (Direction::Ahead, 2_000_000 - 5_003));
        assert_eq!(report.peers.len(), 2);
        let text = report.to_string();
        assert!(text.contains("at least 1994 ms ahead of a majority"), "{text}");
        assert!(
            text.contains("max_clock_skew (250 ms)") && text.contains("2000 ms (± 6 ms) ahead of node 3"),
            "{text}"
        );

        let v = three_ms(-200, -200);
        assert_eq!(v.ahead_of_others_us(1_000_000), Some(200_000 - 5_003));
        assert_eq!(v.may_lead(250, 1_000_000), Ok(()));
    }

    #[test]
    fn a_node_2s_behind_may_not_lead_either() {
        let v = three_ms(2_000, 2_000);
        let report = v.may_lead(250, 1_000_000).unwrap_err();
        assert_eq!(report.direction, Direction::Behind);
        assert!(report.to_string().contains("2000 ms (± 6 ms) behind node 2"), "{report}");
    }

    #[test]
    fn one_outlier_peer_does_not_stop_the_majority_from_leading() {
        // Peer 2 is 2 s slow, peer 3 agrees with us: the slow peer is the outlier, not us.
        let v = three(-2_000, 3);
        assert_eq!(v.ahead_of_others_us(1_000), Some(0));
        assert_eq!(v.may_lead(250, 1_000), Ok(()));
        let v = three(2_000, -3);
        assert_eq!(v.may_lead(250, 1_000), Ok(()));
    }

    #[test]
    fn without_estimates_leading_is_allowed() {
        let single = ClockView::new([], FilterConfig::default());
        assert_eq!(single.ahead_of_others_us(0), None);
        assert_eq!(single.may_lead(250, 0), Ok(()));
        assert_eq!(single.fire_clock(NOW, 0), NOW);
        // Peers that have not answered a probe yet, or only long ago.
        let mut v = ClockView::new([2, 3], FilterConfig::default());
        assert_eq!(v.may_lead(250, 0), Ok(()));
        v.record(2, probe(NOW, -5_000_000, 1_000, 0, 1_000), 0).unwrap();
        v.record(3, probe(NOW, -5_000_000, 1_000, 0, 1_000), 0).unwrap();
        assert!(v.may_lead(250, 0).is_err());
        assert_eq!(v.may_lead(250, 60_000_000), Ok(()), "stale estimates are no evidence");
        // Only one of two peers measured: one slow peer is not a majority.
        let mut v = ClockView::new([2, 3], FilterConfig::default());
        v.record(2, probe(NOW, -5_000_000, 1_000, 0, 1_000), 0).unwrap();
        assert_eq!(v.may_lead(250, 0), Ok(()));
    }

    #[test]
    fn membership_changes_keep_the_samples_of_remaining_peers() {
        let mut v = three(-2_000, -2_000);
        v.set_peers([3, 4, 5, 6]);
        assert_eq!(v.estimates(1_000).iter().map(|(id, _)| *id).collect::<Vec<_>>(), [3]);
        // Five voters now: one slow peer of four is not a majority.
        assert_eq!(v.may_lead(250, 1_000), Ok(()));
    }

    #[test]
    fn fire_clock_subtracts_the_lead_over_the_slowest_peer() {
        // Peers 300 ms and 40 ms behind us, each known to ±8 ms, and 1 ms for truncated readings.
        let v = three(-300, -40);
        assert_eq!(v.fire_clock(NOW, 1_000), NOW - 300 - 8 - 1);
        // A peer only a little ahead still moves it back by what the error leaves of its lead.
        let v = three(500, 5);
        assert_eq!(v.fire_clock(NOW, 1_000), NOW + 5 - 8 - 1);
        // Peers surely ahead of us never move it forward.
        let v = three(500, 40);
        assert_eq!(v.fire_clock(NOW, 1_000), NOW);
        // Four seconds on: the drift allowance (2 ms at 500 ppm) widens the correction.
        let v = three(-300, -40);
        assert_eq!(v.fire_clock(NOW + 4_000, 5_000), NOW + 4_000 - 300 - 10 - 1);
    }

    #[test]
    fn the_majority_clock_ignores_one_outlier_either_way() {
        // Three voters: us, a peer 300 ms behind, a peer 40 ms behind. Two of three clocks (ours
        // and the 40 ms one, at its floor) have passed NOW - 40 - 8 - 1.
        let v = three(-300, -40);
        assert_eq!(v.majority_clock(NOW, 1_000, 3), NOW - 40 - 8 - 1);
        // A peer 2 s behind is outvoted: it no longer makes firing 2 s late.
        let v = three(-2_000, -40);
        assert_eq!(v.majority_clock(NOW, 1_000, 3), NOW - 40 - 8 - 1);
        // Peers ahead never move it past our own clock.
        let v = three(500, 400);
        assert_eq!(v.majority_clock(NOW, 1_000, 3), NOW);
        // With no estimate (fewer readings than a majority) it falls back to the slowest known.
        let v = ClockView::new([2, 3], FilterConfig::default());
        assert_eq!(v.majority_clock(NOW, 1_000, 3), NOW);
        // Five voters, two estimates: three readings make a majority, the slowest of them counts.
        let mut v = three(-300, -40);
        v.set_peers([2, 3, 4, 5]);
        assert_eq!(v.majority_clock(NOW, 1_000, 5), NOW - 300 - 8 - 1);
    }

    #[test]
    fn a_forward_step_of_our_wall_clock_does_not_bring_firing_forward() {
        let v = three(-100, -100);
        // A second later by the monotonic clock, but our wall clock jumped an hour.
        let fire = v.fire_clock(NOW + 1_000 + 3_600_000, 2_000);
        assert_eq!(fire, NOW + 1_000 - 100 - (8 + 1) - 1);
        // A backward step: our own clock is the slowest, and it is used.
        assert_eq!(v.fire_clock(NOW - 60_000, 2_000), NOW - 60_000);
    }

    /// Real time in microseconds, truncated to the milliseconds a clock reports.
    fn ms(us: i64) -> i64 {
        us.div_euclid(1_000)
    }

    /// A probe simulated in microseconds: our wall clock at `real`, the peer's at `real + theta`,
    /// our monotonic clock at `real + mono_base`; all stamps truncated to ms.
    fn simulated(real0: i64, theta: i64, mono_base: i64, d1: i64, turn: i64, d2: i64) -> Sample {
        let (r1, r2, r3) = (real0 + d1, real0 + d1 + turn, real0 + d1 + turn + d2);
        Sample {
            t0: ms(real0),
            t1: ms(r1 + theta),
            t2: ms(r2 + theta),
            t3: ms(r3),
            rtt_us: (ms(r3 + mono_base) - ms(real0 + mono_base)) as u64,
        }
    }

    /// A delay in µs: often none at all or under a millisecond, where the worst asymmetry and the
    /// truncation of the stamps meet, otherwise anything up to half a second.
    fn delay() -> impl Strategy<Value = i64> {
        prop_oneof![Just(0i64), 0i64..1_000, 0i64..500_000]
    }

    proptest! {
        /// Whatever the true offset and however lopsided the delays, the estimate is within its bound.
        #[test]
        fn the_estimate_is_within_its_error(
            real0 in 1_700_000_000_000_000i64..1_900_000_000_000_000,
            theta in -3_600_000_000i64..3_600_000_000,
            mono_base in -1_000_000_000i64..1_000_000_000,
            d1 in delay(), turn in delay(), d2 in delay(),
        ) {
            let s = simulated(real0, theta, mono_base, d1, turn, d2);
            prop_assert_eq!(s.check(), Ok(()));
            let off_by_us = (s.offset_us() as i128 * 1_000 - theta as i128).abs();
            prop_assert!(off_by_us <= s.error_us() as i128 * 1_000, "{s:?}: off by {off_by_us} us");
        }

        /// The fire clock never reads later than this node's clock or than any measured peer's
        /// true clock, however far their clocks are apart.
        #[test]
        fn the_fire_clock_is_behind_every_measured_clock(
            real0 in 1_700_000_000_000_000i64..1_900_000_000_000_000,
            thetas in proptest::collection::vec(-5_000_000i64..5_000_000, 2..5),
            delays in proptest::collection::vec((delay(), delay()), 5),
            later in prop_oneof![0i64..2_000, 0i64..9_000_000],
        ) {
            let mono_base = 42_000_123i64;
            let peers: Vec<u64> = (2..2 + thetas.len() as u64).collect();
            let mut v = ClockView::new(peers.clone(), FilterConfig::default());
            for (i, (&id, &theta)) in peers.iter().zip(&thetas).enumerate() {
                let (d1, d2) = delays[i];
                let s = simulated(real0, theta, mono_base, d1, 0, d2);
                let at_mono = ms(real0 + d1 + d2 + mono_base) as u64;
                v.record(id, s, at_mono).unwrap();
            }
            // After the last reply (each leg is under half a second).
            let now = real0 + 1_000_000 + later;
            let fire = v.fire_clock(ms(now), ms(now + mono_base) as u64);
            prop_assert!(fire <= ms(now));
            for &theta in &thetas {
                prop_assert!(fire <= ms(now + theta), "fire {fire} is later than a peer at {}", ms(now + theta));
            }
        }
    }
}
