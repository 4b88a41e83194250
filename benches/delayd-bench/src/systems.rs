//! The systems compared: delayd and two Redis-backed delay queues, each in a strict and a relaxed
//! durability mode.

/// Which queue implementation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// delayd over its HTTP API.
    Delayd,
    /// The Youzan design: job hash, sorted-set buckets, ready list, every state change in Lua.
    RedisLua,
    /// The ouqiang/delay-queue style: separate commands, no Lua, a 1-second timer.
    RedisPlain,
}

/// One system under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct System {
    /// The implementation.
    pub engine: Engine,
    /// delayd `sync` / Redis `appendfsync always` when true; delayd `async` / `everysec` when false.
    pub strict: bool,
}

impl System {
    /// Every system, in report order.
    pub fn all() -> Vec<System> {
        let mut v = Vec::new();
        for engine in [Engine::Delayd, Engine::RedisLua, Engine::RedisPlain] {
            for strict in [true, false] {
                v.push(System { engine, strict });
            }
        }
        v
    }

    /// Short stable name used in tables, the chart and `--systems`.
    pub fn name(&self) -> String {
        match (self.engine, self.strict) {
            (Engine::Delayd, true) => "delayd-sync",
            (Engine::Delayd, false) => "delayd-async",
            (Engine::RedisLua, true) => "redis-lua-always",
            (Engine::RedisLua, false) => "redis-lua-everysec",
            (Engine::RedisPlain, true) => "redis-plain-always",
            (Engine::RedisPlain, false) => "redis-plain-everysec",
        }
        .to_string()
    }

    /// Needs a redis-server.
    pub fn needs_redis(&self) -> bool {
        self.engine != Engine::Delayd
    }
}
