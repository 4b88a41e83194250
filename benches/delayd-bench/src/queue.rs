//! Client side of every system under test: produce, pop, ack; and the mover loops that the two
//! Redis designs need to promote due jobs.
//!
//! The Redis queues are written from the published descriptions of their designs (the Youzan delay
//! queue article and the ouqiang/delay-queue README and layout); the code here is our own.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use redis::aio::MultiplexedConnection;
use serde::{Deserialize, Serialize};

use crate::http::{Answer, HttpConn};
use crate::systems::{Engine, System};

/// Wall-clock unix time in milliseconds; all systems run on this machine, so one clock serves all.
pub fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

/// One message to produce.
#[derive(Debug, Clone, Copy)]
pub struct Job {
    /// Benchmark-wide sequence number, carried in the body.
    pub seq: u64,
    /// Delay from now.
    pub delay_ms: u64,
    /// Time-to-run once popped.
    pub ttr_ms: u64,
}

/// One popped message.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// Sequence number parsed from the body.
    pub seq: u64,
    /// When the system was told to deliver it (unix ms).
    pub due_ms: i64,
    /// When the pop returned it to us (unix ms).
    pub at_ms: i64,
    pub(crate) token: String,
}

/// Buckets per Redis queue; ouqiang/delay-queue ships with 3.
const BUCKETS: u64 = 3;
/// Jobs a Lua mover promotes per script call, so one call never blocks Redis for long.
const MOVE_LIMIT: i64 = 1000;

pub(crate) fn body_for(seq: u64, due_ms: i64, size: usize) -> String {
    let mut b = format!("{seq}:{due_ms}:");
    while b.len() < size {
        b.push('x');
    }
    b
}

pub(crate) fn parse_body(body: &str) -> Option<(u64, i64)> {
    let mut it = body.splitn(3, ':');
    let seq = it.next()?.parse().ok()?;
    let due = it.next()?.parse().ok()?;
    Some((seq, due))
}

/// A client connection to one system. Cloning shares the produce/ack connection; each consumer
/// should `connect` its own so blocking pops do not stall one another.
#[derive(Clone)]
pub enum Queue {
    /// delayd over HTTP with keep-alive.
    Delayd(DelaydQ),
    /// Either Redis design.
    Redis(RedisQ),
    /// beanstalkd over its text protocol.
    Beanstalk(crate::beanstalk::BeanQ),
}

impl Queue {
    /// Opens a client for `system` on `port`.
    pub fn connect(system: System, port: u16, body_bytes: usize) -> Result<Queue, String> {
        match system.engine {
            Engine::Delayd => Ok(Queue::Delayd(DelaydQ { http: HttpConn::new(port), body_bytes })),
            Engine::Beanstalkd => Ok(Queue::Beanstalk(crate::beanstalk::BeanQ::new(port, body_bytes))),
            engine => Ok(Queue::Redis(RedisQ {
                lua: engine == Engine::RedisLua,
                wait: system.replicated,
                port,
                body_bytes,
                conn: None,
                block: None,
                rr: 0,
            })),
        }
    }

    /// A client of `system` sending to `port`; for a delayd cluster (whose nodes' API ports are
    /// `ports`) one that follows the leader when it changes.
    pub fn connect_group(
        system: System,
        port: u16,
        ports: &[u16],
        body_bytes: usize,
    ) -> Result<Queue, String> {
        if system.engine == Engine::Delayd && ports.len() > 1 {
            let http = HttpConn::following(ports, port, crate::http::CALL_TIMEOUT);
            return Ok(Queue::Delayd(DelaydQ { http, body_bytes }));
        }
        Queue::connect(system, port, body_bytes)
    }

    /// Produces `jobs` in one call (a batch when more than one); per-job success, or an error when
    /// the whole call failed.
    pub async fn produce(&mut self, topic: &str, jobs: &[Job]) -> Result<Vec<bool>, String> {
        match self {
            Queue::Delayd(q) => q.produce(topic, jobs).await,
            Queue::Redis(q) => q.produce(topic, jobs).await,
            Queue::Beanstalk(q) => q.produce(topic, jobs).await,
        }
    }

    /// Like [`Queue::produce`], plus the ids delayd gave the accepted messages (none from the
    /// other systems, whose ids are not looked up).
    pub async fn produce_ids(
        &mut self,
        topic: &str,
        jobs: &[Job],
    ) -> Result<(Vec<bool>, Vec<String>), String> {
        match self {
            Queue::Delayd(q) => {
                let (results, _) = q.produce_results(topic, jobs).await?;
                let ok = results.iter().map(|r| r.deliver_at_ms.is_some()).collect();
                Ok((ok, results.into_iter().filter_map(|r| r.id).collect()))
            }
            _ => Ok((self.produce(topic, jobs).await?, Vec::new())),
        }
    }

    /// Pops up to `max` messages, waiting up to `wait_ms` for the first.
    pub async fn pop(
        &mut self,
        topic: &str,
        max: usize,
        wait_ms: u64,
        ttr_ms: u64,
    ) -> Result<Vec<Delivery>, String> {
        match self {
            Queue::Delayd(q) => q.pop(topic, max, wait_ms, ttr_ms).await,
            Queue::Redis(q) => q.pop(topic, max.max(1), wait_ms, ttr_ms).await,
            Queue::Beanstalk(q) => q.pop(topic, max.max(1), wait_ms).await,
        }
    }

    /// Puts `jobs` on `topic` ready now (setup for the pop + ack cases, not measured); returns how
    /// many were accepted. The delayd and Lua queues take them as produces due now (the Lua mover
    /// promotes them); the plain design gets them written straight in the ready state its 1-second
    /// ticker would leave them in, so the setup does not wait for that ticker.
    pub async fn preload_ready(&mut self, topic: &str, jobs: &[Job]) -> Result<usize, String> {
        match self {
            Queue::Redis(q) if !q.lua => q.plain_ready(topic, jobs).await,
            _ => Ok(self.produce(topic, jobs).await?.into_iter().filter(|ok| *ok).count()),
        }
    }

    /// Messages of `topic` ready to pop now.
    pub async fn ready_count(&mut self, topic: &str) -> Result<usize, String> {
        match self {
            Queue::Delayd(q) => q.ready_count(topic).await,
            Queue::Redis(q) => q.ready_count(topic).await,
            Queue::Beanstalk(q) => q.ready_count(topic).await,
        }
    }

    /// Acknowledges (finishes) a delivery; false when the system no longer knew it.
    pub async fn ack(&mut self, d: &Delivery) -> Result<bool, String> {
        match self {
            Queue::Delayd(q) => q.ack(d).await,
            Queue::Redis(q) => q.ack(d).await,
            Queue::Beanstalk(q) => q.ack(d).await,
        }
    }
}

/// delayd HTTP client: one kept-alive connection (see [`crate::http`]).
#[derive(Clone)]
pub struct DelaydQ {
    http: HttpConn,
    body_bytes: usize,
}

#[derive(Serialize)]
struct MsgOut<'a> {
    body: &'a str,
    delay_ms: u64,
    ttr_ms: u64,
}

#[derive(Serialize)]
struct BatchOut<'a> {
    messages: Vec<MsgOut<'a>>,
}

#[derive(Serialize)]
struct AckOut<'a> {
    receipt: &'a str,
}

#[derive(Deserialize)]
struct ProduceResult {
    deliver_at_ms: Option<i64>,
    id: Option<String>,
}

#[derive(Deserialize)]
struct BatchResult {
    results: Vec<ProduceResult>,
}

#[derive(Deserialize)]
struct PopResult {
    messages: Vec<PoppedMsg>,
}

#[derive(Deserialize)]
struct TopicList {
    topics: Vec<TopicCounts>,
}

#[derive(Deserialize)]
struct TopicCounts {
    topic: String,
    ready: usize,
}

#[derive(Deserialize)]
struct PoppedMsg {
    body: String,
    receipt: String,
    deliver_at_ms: i64,
}

fn to_json<T: Serialize>(v: &T) -> Result<Vec<u8>, String> {
    serde_json::to_vec(v).map_err(|e| e.to_string())
}

/// The body of a 2xx answer as `T`; any other answer is an error naming its status and body.
fn from_json<'a, T: Deserialize<'a>>(a: &'a Answer) -> Result<T, String> {
    if !(200..300).contains(&a.status) {
        return Err(a.error());
    }
    serde_json::from_slice(&a.body).map_err(|e| format!("answer {}: {e}", a.status))
}

impl DelaydQ {
    async fn produce(&mut self, topic: &str, jobs: &[Job]) -> Result<Vec<bool>, String> {
        Ok(self.produce_on(topic, jobs).await?.0)
    }

    /// Produces `jobs` in one call; per-job success and the port of the node that answered.
    pub async fn produce_on(&mut self, topic: &str, jobs: &[Job]) -> Result<(Vec<bool>, u16), String> {
        let (results, port) = self.produce_results(topic, jobs).await?;
        Ok((results.iter().map(|r| r.deliver_at_ms.is_some()).collect(), port))
    }

    async fn produce_results(
        &mut self,
        topic: &str,
        jobs: &[Job],
    ) -> Result<(Vec<ProduceResult>, u16), String> {
        // The due time comes back in the pop as deliver_at_ms, so the body needs only the seq.
        let bodies: Vec<String> = jobs.iter().map(|j| body_for(j.seq, 0, self.body_bytes)).collect();
        let mut msgs =
            jobs.iter().zip(&bodies).map(|(j, body)| MsgOut { body, delay_ms: j.delay_ms, ttr_ms: j.ttr_ms });
        if jobs.len() == 1 {
            let json = to_json(&msgs.next().ok_or("no job")?)?;
            let a = self.http.call("POST", &format!("/v1/topics/{topic}/messages"), Some(&json)).await?;
            let r: ProduceResult = from_json(&a)?;
            return Ok((vec![r], a.port));
        }
        let json = to_json(&BatchOut { messages: msgs.collect() })?;
        let a = self.http.call("POST", &format!("/v1/topics/{topic}/messages/batch"), Some(&json)).await?;
        let r: BatchResult = from_json(&a)?;
        if r.results.len() != jobs.len() {
            return Err(format!("batch of {} got {} results", jobs.len(), r.results.len()));
        }
        Ok((r.results, a.port))
    }

    async fn pop(
        &mut self,
        topic: &str,
        max: usize,
        wait_ms: u64,
        ttr_ms: u64,
    ) -> Result<Vec<Delivery>, String> {
        let path = format!("/v1/topics/{topic}/pop?max={max}&wait_ms={wait_ms}&ttr_ms={ttr_ms}");
        let a = self.http.call("POST", &path, None).await?;
        let at_ms = now_ms();
        let r: PopResult = from_json(&a)?;
        r.messages
            .into_iter()
            .map(|m| {
                let (seq, _) = parse_body(&m.body).ok_or_else(|| format!("foreign body {:?}", m.body))?;
                Ok(Delivery { seq, due_ms: m.deliver_at_ms, at_ms, token: m.receipt })
            })
            .collect()
    }

    async fn ready_count(&mut self, topic: &str) -> Result<usize, String> {
        let a = self.http.call("GET", "/v1/topics", None).await?;
        let list: TopicList = from_json(&a)?;
        Ok(list.topics.iter().find(|t| t.topic == topic).map_or(0, |t| t.ready))
    }

    async fn ack(&mut self, d: &Delivery) -> Result<bool, String> {
        let json = to_json(&AckOut { receipt: &d.token })?;
        let a = self.http.call("POST", "/v1/ack", Some(&json)).await?;
        match a.status {
            200..=299 => Ok(true),
            404 => Ok(false),
            _ => Err(a.error()),
        }
    }
}

// --- Youzan design, all state changes in Lua -------------------------------------------------
//
// job:{id}      hash  topic, body, due, ttr, state (delay|ready|reserved), attempt, bucket
// dq:bucket:{k} zset  id scored by due ms (delayed jobs, and reserved jobs by their TTR deadline)
// dq:ready:{t}  list  ids ready for topic t

const LUA_PRODUCE: &str = r"
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'topic', ARGV[2], 'body', ARGV[3], 'due', ARGV[4], 'ttr', ARGV[5],
  'state', 'delay', 'attempt', 0, 'bucket', KEYS[2])
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1])
return 1
";

const LUA_MOVE: &str = r"
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
for _, id in ipairs(ids) do
  redis.call('ZREM', KEYS[1], id)
  local jk = 'job:' .. id
  local st = redis.call('HGET', jk, 'state')
  if st == 'delay' or st == 'reserved' then
    redis.call('HSET', jk, 'state', 'ready')
    redis.call('RPUSH', 'dq:ready:' .. redis.call('HGET', jk, 'topic'), id)
  end
end
return #ids
";

// The reserve takes up to ARGV[3] ids off the ready list and records each one's TTR deadline in its
// bucket in the same script, so a job is always either on the ready list or in a bucket: a consumer
// that dies at any point loses nothing, and the mover re-queues the job when its TTR runs out.
// KEYS[1] = ready list; ARGV = now ms, TTR ms (0: the job's own), max. Returns id, body, id, body...
const LUA_RESERVE: &str = r"
local out = {}
local max = tonumber(ARGV[3])
while #out < 2 * max do
  local id = redis.call('LPOP', KEYS[1])
  if not id then break end
  local jk = 'job:' .. id
  if redis.call('HGET', jk, 'state') == 'ready' then
    local f = redis.call('HMGET', jk, 'body', 'ttr', 'bucket')
    local ttr = tonumber(ARGV[2])
    if ttr == 0 then ttr = tonumber(f[2]) end
    redis.call('HINCRBY', jk, 'attempt', 1)
    redis.call('HSET', jk, 'state', 'reserved')
    redis.call('ZADD', f[3], tonumber(ARGV[1]) + ttr, id)
    out[#out + 1] = id
    out[#out + 1] = f[1]
  end
end
return out
";

const LUA_FINISH: &str = r"
local b = redis.call('HGET', KEYS[1], 'bucket')
if not b then return 0 end
redis.call('ZREM', b, ARGV[1])
redis.call('DEL', KEYS[1])
return 1
";

fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

fn lua_bucket(id: &str) -> String {
    format!("dq:bucket:{}", fnv(id) % BUCKETS)
}

fn plain_bucket(k: u64) -> String {
    format!("dq_bucket_{}", k % BUCKETS + 1)
}

async fn redis_connect(port: u16) -> Result<MultiplexedConnection, String> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).map_err(|e| e.to_string())?;
    // appendfsync always under load can take longer than the crate's 500 ms default.
    let cfg = redis::AsyncConnectionConfig::new().set_response_timeout(Duration::from_secs(30));
    client.get_multiplexed_async_connection_with_config(&cfg).await.map_err(|e| e.to_string())
}

fn evalsha(src: &str) -> redis::Cmd {
    let mut c = redis::cmd("EVALSHA");
    c.arg(redis::Script::new(src).get_hash());
    c
}

/// Loads every script; a restarted Redis has an empty script cache.
async fn load_scripts(con: &mut MultiplexedConnection) -> Result<(), String> {
    for s in [LUA_PRODUCE, LUA_MOVE, LUA_RESERVE, LUA_FINISH] {
        redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(s)
            .query_async::<String>(con)
            .await
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// ouqiang/delay-queue keeps the job as one serialized value.
#[derive(serde::Serialize, Deserialize)]
struct PlainJob {
    topic: String,
    id: String,
    /// Absolute due time in whole unix seconds, as that design stores it.
    delay: i64,
    ttr: i64,
    body: String,
}

impl PlainJob {
    /// Job `j` of `topic`, due at `due_ms`, with a body of `body_bytes`; its id is its sequence number.
    fn new(topic: &str, j: &Job, due_ms: i64, body_bytes: usize) -> PlainJob {
        PlainJob {
            topic: topic.to_string(),
            id: j.seq.to_string(),
            delay: due_ms / 1000,
            ttr: (j.ttr_ms as i64 / 1000).max(1),
            body: body_for(j.seq, due_ms, body_bytes),
        }
    }
}

/// Client for both Redis designs.
pub struct RedisQ {
    lua: bool,
    /// `WAIT 1 0` after every write: answered only once the replica has it.
    wait: bool,
    port: u16,
    body_bytes: usize,
    conn: Option<MultiplexedConnection>,
    block: Option<MultiplexedConnection>,
    rr: u64,
}

impl Clone for RedisQ {
    fn clone(&self) -> Self {
        // A clone must not share the blocking connection: a BLPOP there would stall the other user.
        RedisQ {
            lua: self.lua,
            wait: self.wait,
            port: self.port,
            body_bytes: self.body_bytes,
            conn: self.conn.clone(),
            block: None,
            rr: self.rr,
        }
    }
}

impl RedisQ {
    async fn conn(&mut self) -> Result<MultiplexedConnection, String> {
        if let Some(c) = &self.conn {
            return Ok(c.clone());
        }
        let mut c = redis_connect(self.port).await?;
        if self.lua {
            load_scripts(&mut c).await?;
        }
        self.conn = Some(c.clone());
        Ok(c)
    }

    /// Ends `pipe` with `WAIT 1 0` (its reply ignored) when this client waits for the replica:
    /// the pipeline's answer then comes once the replica has acknowledged every write before it.
    /// With `appendfsync always` on the replica, Redis writes its acknowledgements only after the
    /// fsync of the writes they cover (7.0: `beforeSleep` flushes the AOF before client output), the
    /// closest Redis comes to "a majority has it durable" (7.2's `WAITAOF` says it outright).
    fn wait_in(&self, pipe: &mut redis::Pipeline) {
        if self.wait {
            pipe.cmd("WAIT").arg(1).arg(0).ignore();
        }
    }

    fn fail<T>(&mut self, e: redis::RedisError) -> Result<T, String> {
        // A dropped or restarted server leaves the connection useless; reconnect on next use.
        self.conn = None;
        self.block = None;
        Err(e.to_string())
    }

    async fn produce(&mut self, topic: &str, jobs: &[Job]) -> Result<Vec<bool>, String> {
        let mut con = self.conn().await?;
        let now = now_ms();
        if self.lua {
            let mut pipe = redis::pipe();
            for j in jobs {
                let id = j.seq.to_string();
                let due = now + j.delay_ms as i64;
                pipe.add_command(
                    evalsha(LUA_PRODUCE)
                        .arg(2)
                        .arg(format!("job:{id}"))
                        .arg(lua_bucket(&id))
                        .arg(&id)
                        .arg(topic)
                        .arg(body_for(j.seq, due, self.body_bytes))
                        .arg(due)
                        .arg(j.ttr_ms)
                        .clone(),
                );
            }
            self.wait_in(&mut pipe);
            match pipe.query_async::<Vec<i64>>(&mut con).await {
                Ok(v) => Ok(v.into_iter().map(|x| x == 1).collect()),
                Err(e) => self.fail(e),
            }
        } else {
            // Two separate commands per job, not atomic, as ouqiang/delay-queue does: one round trip
            // each for a single job; a batch pipelines them, one job after another.
            let mut pipe = redis::pipe();
            for j in jobs {
                let job = PlainJob::new(topic, j, now + j.delay_ms as i64, self.body_bytes);
                let id = &job.id;
                let json = serde_json::to_string(&job).map_err(|e| e.to_string())?;
                let mut set = redis::cmd("SET");
                set.arg(format!("dq_job_{id}")).arg(json);
                let mut zadd = redis::cmd("ZADD");
                zadd.arg(plain_bucket(self.rr)).arg(job.delay).arg(id);
                self.rr += 1;
                if jobs.len() == 1 {
                    let mut wait = redis::pipe();
                    self.wait_in(&mut wait);
                    for c in [set, zadd].into_iter().chain(wait.cmd_iter().cloned()) {
                        if let Err(e) = c.query_async::<redis::Value>(&mut con).await {
                            return self.fail(e);
                        }
                    }
                    return Ok(vec![true]);
                }
                pipe.add_command(set).ignore().add_command(zadd).ignore();
            }
            self.wait_in(&mut pipe);
            match pipe.query_async::<()>(&mut con).await {
                Ok(()) => Ok(vec![true; jobs.len()]),
                Err(e) => self.fail(e),
            }
        }
    }

    async fn block_conn(&mut self) -> Result<MultiplexedConnection, String> {
        if let Some(b) = &self.block {
            return Ok(b.clone());
        }
        let b = redis_connect(self.port).await?;
        self.block = Some(b.clone());
        Ok(b)
    }

    async fn pop(
        &mut self,
        topic: &str,
        max: usize,
        wait_ms: u64,
        ttr_ms: u64,
    ) -> Result<Vec<Delivery>, String> {
        if self.lua {
            self.lua_pop(topic, max, wait_ms, ttr_ms).await
        } else {
            self.plain_pop(topic, max, wait_ms, ttr_ms).await
        }
    }

    /// Lua design: the reserve script first (one round trip when jobs are ready); only when it finds
    /// none, a blocking wait that takes nothing, then the script again.
    async fn lua_pop(
        &mut self,
        topic: &str,
        max: usize,
        wait_ms: u64,
        ttr_ms: u64,
    ) -> Result<Vec<Delivery>, String> {
        let mut con = self.conn().await?;
        let ready = format!("dq:ready:{topic}");
        let deadline = std::time::Instant::now() + Duration::from_millis(wait_ms);
        loop {
            let at_ms = now_ms();
            let mut pipe = redis::pipe();
            pipe.add_command(evalsha(LUA_RESERVE).arg(1).arg(&ready).arg(at_ms).arg(ttr_ms).arg(max).clone());
            // A reserve that took nothing wrote nothing, and its WAIT returns at once.
            self.wait_in(&mut pipe);
            let r: Result<(Vec<String>,), _> = pipe.query_async(&mut con).await;
            let flat = match r {
                Ok((v,)) => v,
                Err(e) => return self.fail(e),
            };
            if !flat.is_empty() {
                return flat
                    .chunks(2)
                    .map(|pair| {
                        let (id, body) = (&pair[0], pair.get(1).map(String::as_str).unwrap_or(""));
                        let (seq, due_ms) =
                            parse_body(body).ok_or_else(|| format!("foreign body {body:?}"))?;
                        Ok(Delivery { seq, due_ms, at_ms, token: id.clone() })
                    })
                    .collect();
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Ok(Vec::new());
            }
            // BLMOVE from the tail back onto the tail leaves the list as it was: a wait for "not
            // empty" that holds no job, so there is nothing a crash here could lose.
            let mut block = self.block_conn().await?;
            let woke: Result<Option<String>, _> = redis::cmd("BLMOVE")
                .arg(&ready)
                .arg(&ready)
                .arg("RIGHT")
                .arg("RIGHT")
                .arg(left.as_secs_f64().max(0.01))
                .query_async(&mut block)
                .await;
            match woke {
                Ok(Some(_)) => continue,
                Ok(None) => return Ok(Vec::new()),
                Err(e) => return self.fail(e),
            }
        }
    }

    /// ouqiang design: BLPOP the topic list, then GET the job and ZADD it at now + TTR, as separate
    /// commands. Kept as that design has it: a consumer that dies between the BLPOP and the ZADD
    /// loses the job. A batch takes up to `max` ids with `LPOP count` (BLPOP only when the list is
    /// empty), then one pipeline of GETs and one of ZADDs.
    async fn plain_pop(
        &mut self,
        topic: &str,
        max: usize,
        wait_ms: u64,
        ttr_ms: u64,
    ) -> Result<Vec<Delivery>, String> {
        let mut con = self.conn().await?;
        let mut ids: Vec<String> = Vec::new();
        if max > 1 {
            let r: Result<Option<Vec<String>>, _> =
                redis::cmd("LPOP").arg(topic).arg(max).query_async(&mut con).await;
            match r {
                Ok(v) => ids = v.unwrap_or_default(),
                Err(e) => return self.fail(e),
            }
        }
        if ids.is_empty() {
            let mut block = self.block_conn().await?;
            let timeout = (wait_ms.max(10) as f64) / 1000.0;
            let popped: Option<(String, String)> =
                match redis::cmd("BLPOP").arg(topic).arg(timeout).query_async(&mut block).await {
                    Ok(v) => v,
                    Err(e) => return self.fail(e),
                };
            let Some((_, id)) = popped else { return Ok(Vec::new()) };
            ids.push(id);
            if max > 1 {
                let r: Result<Option<Vec<String>>, _> =
                    redis::cmd("LPOP").arg(topic).arg(max - 1).query_async(&mut con).await;
                match r {
                    Ok(v) => ids.extend(v.unwrap_or_default()),
                    Err(e) => return self.fail(e),
                }
            }
        }
        let at_ms = now_ms();
        let mut gets = redis::pipe();
        for id in &ids {
            gets.cmd("GET").arg(format!("dq_job_{id}"));
        }
        let raws: Vec<Option<String>> = match gets.query_async(&mut con).await {
            Ok(v) => v,
            Err(e) => return self.fail(e),
        };
        let mut zadds = redis::pipe();
        let mut out = Vec::new();
        for (id, raw) in ids.iter().zip(raws) {
            // Acked (deleted) jobs can still sit in a list; the design skips them.
            let Some(raw) = raw else { continue };
            let job: PlainJob = serde_json::from_str(&raw).map_err(|e| e.to_string())?;
            let ttr_s = if ttr_ms > 0 { (ttr_ms as i64 / 1000).max(1) } else { job.ttr };
            zadds.cmd("ZADD").arg(plain_bucket(self.rr)).arg(at_ms / 1000 + ttr_s).arg(id).ignore();
            self.rr += 1;
            let (seq, due_ms) =
                parse_body(&job.body).ok_or_else(|| format!("foreign body {:?}", job.body))?;
            out.push(Delivery { seq, due_ms, at_ms, token: id.clone() });
        }
        if !out.is_empty() {
            self.wait_in(&mut zadds);
            if let Err(e) = zadds.query_async::<()>(&mut con).await {
                return self.fail(e);
            }
        }
        Ok(out)
    }

    /// The plain design's ready state, written directly: the job value and its id on the topic list.
    async fn plain_ready(&mut self, topic: &str, jobs: &[Job]) -> Result<usize, String> {
        let mut con = self.conn().await?;
        let now = now_ms();
        let mut pipe = redis::pipe();
        for j in jobs {
            let job = PlainJob::new(topic, j, now, self.body_bytes);
            let id = &job.id;
            let json = serde_json::to_string(&job).map_err(|e| e.to_string())?;
            pipe.cmd("SET").arg(format!("dq_job_{id}")).arg(json).ignore();
            pipe.cmd("RPUSH").arg(topic).arg(id).ignore();
        }
        self.wait_in(&mut pipe);
        match pipe.query_async::<()>(&mut con).await {
            Ok(()) => Ok(jobs.len()),
            Err(e) => self.fail(e),
        }
    }

    async fn ready_count(&mut self, topic: &str) -> Result<usize, String> {
        let mut con = self.conn().await?;
        let key = if self.lua { format!("dq:ready:{topic}") } else { topic.to_string() };
        match redis::cmd("LLEN").arg(key).query_async::<usize>(&mut con).await {
            Ok(n) => Ok(n),
            Err(e) => self.fail(e),
        }
    }

    async fn ack(&mut self, d: &Delivery) -> Result<bool, String> {
        let mut con = self.conn().await?;
        let mut pipe = redis::pipe();
        if self.lua {
            pipe.add_command(
                evalsha(LUA_FINISH).arg(1).arg(format!("job:{}", d.token)).arg(&d.token).clone(),
            );
        } else {
            pipe.cmd("DEL").arg(format!("dq_job_{}", d.token));
        }
        self.wait_in(&mut pipe);
        match pipe.query_async::<(i64,)>(&mut con).await {
            Ok((n,)) => Ok(n == 1),
            Err(e) => self.fail(e),
        }
    }
}

/// Runs the mover a Redis design needs until `stop` is set: the Lua design's loop promotes due jobs
/// every `lua_tick`; the plain design runs one 1-second ticker per bucket. Errors (a killed server)
/// make it reconnect and carry on.
pub fn spawn_mover(
    system: System,
    port: u16,
    lua_tick: Duration,
    stop: Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    match system.engine {
        // Both promote due jobs themselves.
        Engine::Delayd | Engine::Beanstalkd => Vec::new(),
        Engine::RedisLua => vec![tokio::spawn(lua_mover(port, lua_tick, stop))],
        Engine::RedisPlain => {
            (0..BUCKETS).map(|k| tokio::spawn(plain_timer(port, k, stop.clone()))).collect()
        }
    }
}

// The mover sends no WAIT on the replicated system: the replication stream is ordered, so the
// WAIT of the reserve that hands a promoted job to a consumer covers its promotion too.
async fn lua_mover(port: u16, tick: Duration, stop: Arc<AtomicBool>) {
    let mut con: Option<MultiplexedConnection> = None;
    let mut interval = tokio::time::interval(tick);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !stop.load(Ordering::Relaxed) {
        interval.tick().await;
        if con.is_none() {
            con = match redis_connect(port).await {
                Ok(mut c) => load_scripts(&mut c).await.ok().map(|_| c),
                Err(_) => None,
            };
        }
        let Some(c) = con.as_mut() else { continue };
        'buckets: for k in 0..BUCKETS {
            loop {
                let moved: Result<i64, _> = evalsha(LUA_MOVE)
                    .arg(1)
                    .arg(format!("dq:bucket:{k}"))
                    .arg(now_ms())
                    .arg(MOVE_LIMIT)
                    .query_async(c)
                    .await;
                match moved {
                    Ok(n) if n >= MOVE_LIMIT => continue,
                    Ok(_) => break,
                    Err(_) => {
                        con = None;
                        break 'buckets;
                    }
                }
            }
        }
    }
}

async fn plain_timer(port: u16, k: u64, stop: Arc<AtomicBool>) {
    let mut con: Option<MultiplexedConnection> = None;
    let mut interval = tokio::time::interval(Duration::from_secs(1));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let bucket = plain_bucket(k);
    let mut rr = k;
    while !stop.load(Ordering::Relaxed) {
        interval.tick().await;
        let tick_s = now_ms() / 1000;
        if con.is_none() {
            con = redis_connect(port).await.ok();
        }
        let Some(c) = con.as_mut() else { continue };
        if plain_tick(c, &bucket, tick_s, &mut rr, &stop).await.is_err() {
            con = None;
        }
    }
}

/// One tick of the ouqiang design: look at the head of the bucket, one job per round trip.
async fn plain_tick(
    c: &mut MultiplexedConnection,
    bucket: &str,
    tick_s: i64,
    rr: &mut u64,
    stop: &AtomicBool,
) -> redis::RedisResult<()> {
    while !stop.load(Ordering::Relaxed) {
        let head: Vec<(String, i64)> =
            redis::cmd("ZRANGE").arg(bucket).arg(0).arg(0).arg("WITHSCORES").query_async(c).await?;
        let Some((id, score)) = head.into_iter().next() else { return Ok(()) };
        if score > tick_s {
            return Ok(());
        }
        let raw: Option<String> = redis::cmd("GET").arg(format!("dq_job_{id}")).query_async(c).await?;
        let Some(job) = raw.and_then(|r| serde_json::from_str::<PlainJob>(&r).ok()) else {
            redis::cmd("ZREM").arg(bucket).arg(&id).query_async::<redis::Value>(c).await?;
            continue;
        };
        if job.delay > tick_s {
            *rr += 1;
            redis::cmd("ZADD")
                .arg(plain_bucket(*rr))
                .arg(job.delay)
                .arg(&id)
                .query_async::<redis::Value>(c)
                .await?;
            redis::cmd("ZREM").arg(bucket).arg(&id).query_async::<redis::Value>(c).await?;
            continue;
        }
        redis::cmd("RPUSH").arg(&job.topic).arg(&id).query_async::<redis::Value>(c).await?;
        redis::cmd("ZREM").arg(bucket).arg(&id).query_async::<redis::Value>(c).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_round_trips_seq_and_due() {
        let b = body_for(42, 1_700_000_000_123, 64);
        assert_eq!(b.len(), 64);
        assert_eq!(parse_body(&b), Some((42, 1_700_000_000_123)));
        assert_eq!(parse_body("nonsense"), None);
    }

    /// Against a real redis-server (skipped without one): a Lua pop reserves up to `max` jobs in one
    /// call and, in that call, puts each in its bucket at its TTR deadline; the mover re-queues a job
    /// whose TTR ran out; an ack removes the job for good.
    #[tokio::test]
    async fn lua_reserve_records_the_deadline_and_the_mover_requeues_on_ttr() {
        use crate::servers::{which, Programs, Server};
        let Some(redis) = which("redis-server") else {
            eprintln!("skipped: redis-server is not installed");
            return;
        };
        let sys = System::single(Engine::RedisLua, false);
        let progs = Programs {
            delayd: std::path::PathBuf::new(),
            redis: Some(redis),
            beanstalkd: None,
            tmp_base: None,
            delayd_env: Vec::new(),
            server_cpus: None,
        };
        let server = Server::start(sys, &progs).await.expect("redis-server starts");
        let stop = Arc::new(AtomicBool::new(false));
        let movers = spawn_mover(sys, server.port, Duration::from_millis(10), stop.clone());
        let mut q = Queue::connect(sys, server.port, 32).expect("client");
        let jobs: Vec<Job> = (0..5).map(|seq| Job { seq, delay_ms: 0, ttr_ms: 60_000 }).collect();
        assert_eq!(q.produce("t", &jobs).await.expect("produce"), vec![true; 5]);
        let ready = |mut q: Queue| async move { q.ready_count("t").await.expect("LLEN") };
        let t0 = std::time::Instant::now();
        while ready(q.clone()).await < 5 {
            assert!(t0.elapsed() < Duration::from_secs(5), "the mover never promoted the jobs");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }

        let got = q.pop("t", 3, 100, 60_000).await.expect("pop");
        assert_eq!(got.len(), 3);
        assert_eq!(ready(q.clone()).await, 2, "the reserved jobs left the ready list");
        let mut con = redis_connect(server.port).await.expect("connect");
        for d in &got {
            let deadline: Option<i64> = redis::cmd("ZSCORE")
                .arg(lua_bucket(&d.token))
                .arg(&d.token)
                .query_async(&mut con)
                .await
                .expect("ZSCORE");
            assert_eq!(
                deadline,
                Some(d.at_ms + 60_000),
                "job {} is in its bucket at its TTR deadline",
                d.token
            );
        }

        // A 1 ms TTR: the mover puts the two jobs back on the ready list, not the 60 s ones.
        assert_eq!(q.pop("t", 16, 100, 1).await.expect("pop").len(), 2);
        let t0 = std::time::Instant::now();
        while ready(q.clone()).await < 2 {
            assert!(t0.elapsed() < Duration::from_secs(5), "expired reservations were not re-queued");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(ready(q.clone()).await, 2);

        assert!(q.ack(&got[0]).await.expect("ack"));
        assert!(!q.ack(&got[0]).await.expect("second ack"), "a finished job is gone");
        stop.store(true, Ordering::Relaxed);
        for m in movers {
            m.abort();
        }
        server.finish().expect("server stops and its data dir is removed");
    }
}
