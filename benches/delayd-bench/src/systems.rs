//! The systems compared: delayd and two Redis-backed delay queues, each in a strict and a relaxed
//! durability mode, and the replicated setups of issue 27 (a three-node delayd cluster, a Redis
//! master with one replica and `WAIT`).

/// Which queue implementation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// delayd over its HTTP API.
    Delayd,
    /// The Youzan design: job hash, sorted-set buckets, ready list, every state change in Lua.
    RedisLua,
    /// The ouqiang/delay-queue style: separate commands, no Lua, a 1-second timer.
    RedisPlain,
    /// beanstalkd (Debian's package) over its text protocol, binlog on.
    Beanstalkd,
}

/// One system under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct System {
    /// The implementation.
    pub engine: Engine,
    /// delayd `sync` / Redis `appendfsync always` when true; delayd `async` / `everysec` when false.
    pub strict: bool,
    /// delayd: three nodes on loopback, the load sent to the leader. Redis: a master and one
    /// replica, `WAIT 1 0` after every write.
    pub replicated: bool,
}

impl System {
    /// A single-server system.
    pub const fn single(engine: Engine, strict: bool) -> System {
        System { engine, strict, replicated: false }
    }

    /// Three delayd nodes, `flush = sync`.
    pub const CLUSTER3_SYNC: System = System { engine: Engine::Delayd, strict: true, replicated: true };

    /// The Lua design on a Redis master with one replica, `appendfsync always` on both, `WAIT 1 0`
    /// after every write.
    pub const REDIS_REPLICA_WAIT: System =
        System { engine: Engine::RedisLua, strict: true, replicated: true };

    /// beanstalkd with its binlog fsynced after every write (`-b DIR -f 0`): the peer of delayd-sync.
    pub const BEANSTALKD: System = System { engine: Engine::Beanstalkd, strict: true, replicated: false };

    /// Every system `--systems` can name, in report order.
    pub fn all() -> Vec<System> {
        let mut v = Self::default_set();
        v.extend([Self::CLUSTER3_SYNC, Self::REDIS_REPLICA_WAIT]);
        v
    }

    /// The systems of a run that names none: the single-server ones. The replicated ones start
    /// several servers and have their own comparison (docs/benchmarks.md, issue 27), so they run
    /// only when named.
    pub fn default_set() -> Vec<System> {
        let mut v = Vec::new();
        for engine in [Engine::Delayd, Engine::RedisLua, Engine::RedisPlain] {
            for strict in [true, false] {
                v.push(System::single(engine, strict));
            }
        }
        v.push(Self::BEANSTALKD);
        v
    }

    /// Short stable name used in tables, the chart and `--systems`.
    pub fn name(&self) -> String {
        match (self.engine, self.strict, self.replicated) {
            (Engine::Delayd, true, false) => "delayd-sync",
            (Engine::Delayd, false, false) => "delayd-async",
            (Engine::RedisLua, true, false) => "redis-lua-always",
            (Engine::RedisLua, false, false) => "redis-lua-everysec",
            (Engine::RedisPlain, true, false) => "redis-plain-always",
            (Engine::RedisPlain, false, false) => "redis-plain-everysec",
            (Engine::Delayd, true, true) => "delayd-cluster3-sync",
            (Engine::Delayd, false, true) => "delayd-cluster3-async",
            (Engine::RedisLua, true, true) => "redis-replica-wait",
            (Engine::RedisLua, false, true) => "redis-replica-wait-everysec",
            (Engine::RedisPlain, true, true) => "redis-plain-replica-wait",
            (Engine::RedisPlain, false, true) => "redis-plain-replica-wait-everysec",
            (Engine::Beanstalkd, _, _) => "beanstalkd-fsync",
        }
        .to_string()
    }

    /// Needs a redis-server.
    pub fn needs_redis(&self) -> bool {
        matches!(self.engine, Engine::RedisLua | Engine::RedisPlain)
    }

    /// One or more delayd servers.
    pub fn is_delayd(&self) -> bool {
        self.engine == Engine::Delayd
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_the_replicated_systems_run_only_when_named() {
        let all = System::all();
        let mut names: Vec<String> = all.iter().map(System::name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), all.len());
        assert!(names.contains(&"delayd-cluster3-sync".to_string()));
        assert!(names.contains(&"redis-replica-wait".to_string()));
        assert!(System::default_set().iter().all(|s| !s.replicated));
        assert!(System::default_set().contains(&System::BEANSTALKD));
        assert!(!System::BEANSTALKD.needs_redis() && !System::BEANSTALKD.is_delayd());
    }
}
