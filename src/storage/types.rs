//! Newtypes for the numbers the store passes around, so that a signature says which one it takes:
//! log offsets, queue indexes, unix milliseconds and id hashes. Each is its `u64` in memory and on
//! disk (the codecs write `.get()`), and prints as that number.

/// Defines a `u64` newtype with `new`, `get` and a `Display` of the bare number.
macro_rules! u64_newtype {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
        #[repr(transparent)]
        pub struct $name(u64);

        impl $name {
            /// Wraps the bare number.
            #[inline]
            pub const fn new(v: u64) -> $name {
                $name(v)
            }

            /// The bare number.
            #[inline]
            pub const fn get(self) -> u64 {
                self.0
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                self.0.fmt(f)
            }
        }
    };
}

u64_newtype!(
    /// A byte offset in the commit log (the log is one address space across its segments).
    LogOffset
);
u64_newtype!(
    /// An entry's position in a consume queue (0 is the first entry ever appended).
    QueueIndex
);
u64_newtype!(
    /// A unix time in milliseconds.
    UnixMs
);
u64_newtype!(
    /// A message id's hash (see `format::id_hash`).
    IdHash
);

impl LogOffset {
    /// The offset `n` bytes further on.
    #[inline]
    pub const fn plus(self, n: u64) -> LogOffset {
        LogOffset(self.0 + n)
    }
}

impl QueueIndex {
    /// The index `n` entries further on.
    #[inline]
    pub const fn plus(self, n: u64) -> QueueIndex {
        QueueIndex(self.0 + n)
    }
}
