//! Topics: pause, push subscriptions, the `max_topics` limit and the topic listing.

use std::collections::BTreeSet;

use crate::error::{Error, Result};
use crate::message::{PushConfig, TopicInfo};
use crate::storage::format::{self, Record};
use crate::storage::store::{dead_letter_topic, TopicQueue};

use super::{validate_topic, Engine};

impl Engine {
    /// Pauses (`true`) or resumes a topic, durably: one Pause record, none when it already is so.
    pub fn set_paused(&mut self, topic: &str, paused: bool) -> Result<()> {
        self.writable()?;
        validate_topic(topic)?;
        if self.store.is_paused(topic) == paused {
            return Ok(());
        }
        if paused {
            self.may_name_topic(topic)?;
        }
        self.append(&Record::Pause(format::Pause { paused, time_ms: self.now(), topic: topic.as_bytes() }))?;
        if !paused {
            // Long polls waiting on it look again now rather than at their deadline.
            self.store.touch(topic);
        }
        Ok(())
    }

    /// Sets (or replaces) `topic`'s push subscription, or removes it (`None`); durable, one Push
    /// record. Removing a subscription there is none of is `NotFound`.
    pub fn set_push(&mut self, topic: &str, cfg: Option<&PushConfig>) -> Result<()> {
        self.writable()?;
        validate_topic(topic)?;
        if cfg.is_none() && self.store.push_at(topic).is_none() {
            return Err(Error::NotFound(format!("topic {topic:?} has no push subscription")));
        }
        if cfg.is_some() {
            self.may_name_topic(topic)?;
        }
        let secret = cfg.and_then(|c| c.secret.as_deref()).unwrap_or("");
        let target = match cfg {
            None => format::PushTarget::None,
            Some(c) if c.nats_subject.is_some() => format::PushTarget::Nats,
            Some(_) => format::PushTarget::Webhook,
        };
        let subject = cfg.and_then(|c| c.nats_subject.as_deref()).unwrap_or("");
        self.append(&Record::Push(format::Push {
            target,
            time_ms: self.now(),
            timeout_ms: cfg.map_or(0, |c| c.timeout_ms),
            max_in_flight: cfg.map_or(0, |c| c.max_in_flight),
            topic: topic.as_bytes(),
            url: cfg.map_or(&b""[..], |c| c.url.as_bytes()),
            subject: subject.as_bytes(),
            secret: secret.as_bytes(),
        }))?;
        Ok(())
    }

    /// `topic`'s push subscription, if it has one (read from the record in effect).
    pub fn push_of(&self, topic: &str) -> Result<Option<PushConfig>> {
        let Some(at) = self.store.push_at(topic) else { return Ok(None) };
        match self.store.record_at(at)? {
            Record::Push(p) if p.target != format::PushTarget::None => Ok(Some(PushConfig {
                topic: topic.to_string(),
                url: String::from_utf8_lossy(p.url).into_owned(),
                nats_subject: (p.target == format::PushTarget::Nats)
                    .then(|| String::from_utf8_lossy(p.subject).into_owned()),
                secret: (!p.secret.is_empty()).then(|| String::from_utf8_lossy(p.secret).into_owned()),
                timeout_ms: p.timeout_ms,
                max_in_flight: p.max_in_flight,
                created_at_ms: p.time_ms,
            })),
            _ => Err(Error::Corrupt {
                file: "commitlog".into(),
                offset: at.get(),
                reason: format!("the push subscription of {topic:?} does not point at a Push record"),
            }),
        }
    }

    /// Every push subscription, and a number that changes whenever one is set or removed.
    pub fn pushes(&self) -> Result<(u64, Vec<PushConfig>)> {
        let mut out = Vec::new();
        for topic in self.store.push_topics() {
            out.extend(self.push_of(topic)?);
        }
        Ok((self.store.push_changes(), out))
    }

    /// Refuses a change that would make `topic` a new topic past `max_topics`. A topic exists
    /// once it has a queue, a pause or a push subscription: each is kept (and listed) for good,
    /// so every route that makes one obeys the same limit.
    pub(super) fn may_name_topic(&self, topic: &str) -> Result<()> {
        if self.store.knows_topic(topic) {
            return Ok(());
        }
        let count = self.store.topic_count();
        if count >= self.cfg.max_topics {
            return Err(Error::TooManyTopics(format!(
                "{count} topics exist, the most max_topics allows; topic {topic:?} would be new"
            )));
        }
        Ok(())
    }

    /// Every topic with a queue, a count, a pause or flow control, by name, with its counts.
    pub fn topics(&self) -> Vec<TopicInfo> {
        let mut names: BTreeSet<&str> = self.store.topic_queues().map(|(name, _)| name).collect();
        names.extend(self.store.paused_topics());
        names.extend(self.store.flow_topics());
        names
            .into_iter()
            .map(|name| {
                let counts =
                    |q: Option<&TopicQueue>| q.map_or((0, 0, 0), |q| (q.ready, q.reserved, q.delayed));
                let (ready, reserved, delayed) = counts(self.store.topic_queue(name));
                let dlq = (!name.ends_with(".dlq"))
                    .then(|| counts(self.store.topic_queue(&dead_letter_topic(name))));
                TopicInfo {
                    topic: name.to_string(),
                    ready,
                    reserved,
                    delayed,
                    dead_lettered: dlq.map_or(0, |(r, v, d)| r + v + d),
                    paused: self.store.is_paused(name),
                    flow: self.flow_of(name).ok().flatten(),
                }
            })
            .collect()
    }
}
