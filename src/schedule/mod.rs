//! Delay levels: parsing, planning hops, and the per-level scheduler.

pub mod clock;
pub mod levels;
pub mod scheduler;
