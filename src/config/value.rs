//! The kinds of value a key holds, and the one parser of each.
//!
//! Every source reads a key through its kind: the environment and flags give text, and the file
//! gives a TOML string (the same text), number, boolean or list, which the kind turns into the
//! same text or items before parsing. So a value means the same wherever it is written, and a bad
//! one gets the same message. [`Kind::show`] writes a value the way [`Kind::parse`] reads it back
//! (what `--help` shows as the default).

use std::marker::PhantomData;
use std::path::PathBuf;

use crate::units::{fmt_ms, fmt_size, parse_duration, parse_duration_list, parse_size, parse_u64};

/// How one kind of value is read and shown.
pub(super) trait Kind {
    /// What the key holds.
    type Value;
    /// Whether the value is a secret, kept out of `--help`.
    const SECRET: bool = false;
    /// What a value looks like, for the message about a TOML value of the wrong type.
    fn expecting() -> String;
    /// Reads the value from text, as the environment, a flag or a TOML string gives it. The error
    /// names the value; the caller adds where it came from.
    fn parse(text: &str) -> Result<Self::Value, String>;
    /// The text [`Kind::parse`] reads back; `None` for a key left unset.
    fn show(value: &Self::Value) -> Option<String>;
    /// Reads a TOML value: a string as text; other types only where a kind takes them.
    fn from_toml(value: &toml::Value) -> Result<Self::Value, String> {
        match value {
            toml::Value::String(s) => Self::parse(s),
            other => Err(wrong_type::<Self>(other)),
        }
    }
}

/// The message for a TOML value of a type the key does not take; it shows a scalar value itself.
fn wrong_type<K: Kind + ?Sized>(value: &toml::Value) -> String {
    let found = match value {
        toml::Value::Array(_) | toml::Value::Table(_) => format!("a {}", value.type_str()),
        scalar => format!("the {} {scalar}", scalar.type_str()),
    };
    format!("expected {}, found {found}", K::expecting())
}

/// A TOML number as the text a source would write; a negative one is refused here, as no key
/// takes one.
fn number_text(n: i64) -> Result<String, String> {
    if n < 0 {
        return Err(format!("{n} is negative"));
    }
    Ok(n.to_string())
}

/// A TOML string or non-negative integer, read as the same text.
fn scalar<K: Kind + ?Sized>(value: &toml::Value) -> Result<K::Value, String> {
    match value {
        toml::Value::String(s) => K::parse(s),
        toml::Value::Integer(n) => K::parse(&number_text(*n)?),
        other => Err(wrong_type::<K>(other)),
    }
}

/// Free text, trimmed (an address, a log filter).
pub(super) struct Text;

impl Kind for Text {
    type Value = String;
    fn expecting() -> String {
        "a string".into()
    }
    fn parse(text: &str) -> Result<String, String> {
        Ok(text.trim().to_string())
    }
    fn show(value: &String) -> Option<String> {
        Some(value.clone())
    }
}

/// A file-system path.
pub(super) struct Path;

impl Kind for Path {
    type Value = PathBuf;
    fn expecting() -> String {
        "a path".into()
    }
    fn parse(text: &str) -> Result<PathBuf, String> {
        Ok(PathBuf::from(text.trim()))
    }
    fn show(value: &PathBuf) -> Option<String> {
        Some(value.display().to_string())
    }
}

/// What an empty token is told, wherever it is written.
pub(super) const EMPTY_TOKEN: &str =
    "must not be empty; leave it unset instead (auth_token unset turns authentication off)";

/// A secret that may be left unset but never set empty: an empty token must not quietly turn
/// authentication off.
pub(super) struct Token;

impl Kind for Token {
    type Value = Option<String>;
    const SECRET: bool = true;
    fn expecting() -> String {
        "a string".into()
    }
    fn parse(text: &str) -> Result<Option<String>, String> {
        let t = text.trim();
        if t.is_empty() {
            return Err(EMPTY_TOKEN.into());
        }
        Ok(Some(t.to_string()))
    }
    fn show(value: &Option<String>) -> Option<String> {
        value.clone()
    }
}

/// A type whose values are named: the names a key of that type takes, compared without case.
pub(super) trait Choices: Copy + PartialEq + 'static {
    /// Every name and its value; the first name of a value is the one shown.
    const OPTIONS: &'static [(&'static str, Self)];
}

/// One of a fixed set of names.
pub(super) struct Choice<T>(PhantomData<T>);

impl<T: Choices> Kind for Choice<T> {
    type Value = T;
    fn expecting() -> String {
        let names: Vec<&str> = T::OPTIONS.iter().map(|(name, _)| *name).collect();
        format!("one of {}", names.join(", "))
    }
    fn parse(text: &str) -> Result<T, String> {
        let v = text.trim();
        match T::OPTIONS.iter().find(|(name, _)| name.eq_ignore_ascii_case(v)) {
            Some((_, value)) => Ok(*value),
            None => Err(format!("{v:?} is not {}", Self::expecting())),
        }
    }
    fn show(value: &T) -> Option<String> {
        T::OPTIONS.iter().find(|(_, v)| v == value).map(|(name, _)| name.to_string())
    }
    fn from_toml(value: &toml::Value) -> Result<T, String> {
        match value {
            toml::Value::String(s) => Self::parse(s),
            // A TOML boolean is the name `true` or `false`, for the keys that take them.
            toml::Value::Boolean(b) => Self::parse(&b.to_string()),
            other => Err(wrong_type::<Self>(other)),
        }
    }
}

impl Choices for bool {
    const OPTIONS: &'static [(&'static str, bool)] =
        &[("true", true), ("false", false), ("on", true), ("off", false), ("1", true), ("0", false)];
}

/// A duration, held in milliseconds.
pub(super) struct Duration;

impl Kind for Duration {
    type Value = u64;
    fn expecting() -> String {
        "a duration such as \"10s\" or a number of ms".into()
    }
    fn parse(text: &str) -> Result<u64, String> {
        parse_duration(text)
    }
    fn show(value: &u64) -> Option<String> {
        Some(fmt_ms(*value))
    }
    fn from_toml(value: &toml::Value) -> Result<u64, String> {
        scalar::<Self>(value)
    }
}

/// A size, held in bytes.
pub(super) struct Size;

impl Kind for Size {
    type Value = u64;
    fn expecting() -> String {
        "a size such as \"4MiB\" or a number of bytes".into()
    }
    fn parse(text: &str) -> Result<u64, String> {
        parse_size(text)
    }
    fn show(value: &u64) -> Option<String> {
        Some(fmt_size(*value))
    }
    fn from_toml(value: &toml::Value) -> Result<u64, String> {
        scalar::<Self>(value)
    }
}

/// A count that must fit its field's type.
pub(super) struct Count<T>(PhantomData<T>);

/// A count from text; the error names the value.
pub(super) fn parse_count<T: TryFrom<u64>>(text: &str) -> Result<T, String> {
    T::try_from(parse_u64(text)?).map_err(|_| format!("{:?} is too large", text.trim()))
}

impl<T: TryFrom<u64> + ToString> Kind for Count<T> {
    type Value = T;
    fn expecting() -> String {
        "a number".into()
    }
    fn parse(text: &str) -> Result<T, String> {
        parse_count(text)
    }
    fn show(value: &T) -> Option<String> {
        Some(value.to_string())
    }
    fn from_toml(value: &toml::Value) -> Result<T, String> {
        scalar::<Self>(value)
    }
}

/// A count that may be left unset (its default then comes from another key).
pub(super) struct OptionalCount;

impl Kind for OptionalCount {
    type Value = Option<usize>;
    fn expecting() -> String {
        "a number".into()
    }
    fn parse(text: &str) -> Result<Option<usize>, String> {
        parse_count(text).map(Some)
    }
    fn show(value: &Option<usize>) -> Option<String> {
        value.map(|n| n.to_string())
    }
    fn from_toml(value: &toml::Value) -> Result<Option<usize>, String> {
        scalar::<Self>(value)
    }
}

/// A count, or the word `auto` (`None`: sized by the program).
pub(super) struct AutoCount;

impl Kind for AutoCount {
    type Value = Option<usize>;
    fn expecting() -> String {
        "a number or \"auto\"".into()
    }
    fn parse(text: &str) -> Result<Option<usize>, String> {
        if text.trim().eq_ignore_ascii_case("auto") {
            return Ok(None);
        }
        parse_count(text).map(Some)
    }
    fn show(value: &Option<usize>) -> Option<String> {
        Some(value.map_or("auto".into(), |n| n.to_string()))
    }
    fn from_toml(value: &toml::Value) -> Result<Option<usize>, String> {
        scalar::<Self>(value)
    }
}

/// A number of deliveries, or the word `unlimited` (`None`).
pub(super) struct AttemptsLimit;

impl Kind for AttemptsLimit {
    type Value = Option<u32>;
    fn expecting() -> String {
        "a number or \"unlimited\"".into()
    }
    fn parse(text: &str) -> Result<Option<u32>, String> {
        if text.trim().eq_ignore_ascii_case("unlimited") {
            return Ok(None);
        }
        parse_count(text).map(Some)
    }
    fn show(value: &Option<u32>) -> Option<String> {
        Some(value.map_or("unlimited".into(), |n| n.to_string()))
    }
    fn from_toml(value: &toml::Value) -> Result<Option<u32>, String> {
        scalar::<Self>(value)
    }
}

/// A list of durations in milliseconds: a TOML array of items, or one text with the items
/// separated by commas and/or spaces. Each item is read as a [`Duration`].
pub(super) struct Durations;

impl Kind for Durations {
    type Value = Vec<u64>;
    fn expecting() -> String {
        "a list of durations such as [\"1s\", \"5s\"] or \"1s 5s\"".into()
    }
    fn parse(text: &str) -> Result<Vec<u64>, String> {
        parse_duration_list(text)
    }
    fn show(value: &Vec<u64>) -> Option<String> {
        Some(value.iter().map(|m| fmt_ms(*m)).collect::<Vec<_>>().join(" "))
    }
    fn from_toml(value: &toml::Value) -> Result<Vec<u64>, String> {
        match value {
            toml::Value::String(s) => Self::parse(s),
            // One item may have several units with a space between (`"1h 30m"`), so items are
            // read one by one rather than joined into one text.
            toml::Value::Array(items) => items
                .iter()
                .map(|item| match item {
                    toml::Value::String(_) | toml::Value::Integer(_) => Duration::from_toml(item),
                    _ => Err(wrong_type::<Self>(item)),
                })
                .collect(),
            other => Err(wrong_type::<Self>(other)),
        }
    }
}

/// A list key's TOML value: a string read as text, or an array of strings joined as the text
/// would give them.
fn list_from_toml<K: Kind + ?Sized>(value: &toml::Value) -> Result<K::Value, String> {
    match value {
        toml::Value::String(s) => K::parse(s),
        toml::Value::Array(items) => {
            let names = items
                .iter()
                .map(|item| item.as_str().ok_or_else(|| wrong_type::<K>(item)))
                .collect::<Result<Vec<_>, _>>()?;
            K::parse(&names.join(" "))
        }
        other => Err(wrong_type::<K>(other)),
    }
}

/// Host names, lower-cased (hosts compare without case), at least one; unset allows any. Text
/// separates them with spaces or commas.
pub(super) struct Hosts;

impl Kind for Hosts {
    type Value = Option<Vec<String>>;
    fn expecting() -> String {
        "a list of host names such as [\"hooks.internal\"] or \"a.example b.example\"".into()
    }
    fn parse(text: &str) -> Result<Option<Vec<String>>, String> {
        let hosts: Vec<String> =
            text.split([' ', ',']).filter(|h| !h.is_empty()).map(str::to_ascii_lowercase).collect();
        if hosts.is_empty() {
            return Err("must name at least one host; leave push_allowed_hosts unset to allow any".into());
        }
        Ok(Some(hosts))
    }
    fn show(value: &Option<Vec<String>>) -> Option<String> {
        value.as_ref().map(|hosts| hosts.join(" "))
    }
    fn from_toml(value: &toml::Value) -> Result<Option<Vec<String>>, String> {
        list_from_toml::<Self>(value)
    }
}

/// Text that may be left unset (an address, a URL); set, it must not be empty.
pub(super) struct OptionalText;

impl Kind for OptionalText {
    type Value = Option<String>;
    fn expecting() -> String {
        "a string".into()
    }
    fn parse(text: &str) -> Result<Option<String>, String> {
        let t = text.trim();
        if t.is_empty() {
            return Err("must not be empty; leave it unset instead".into());
        }
        Ok(Some(t.to_string()))
    }
    fn show(value: &Option<String>) -> Option<String> {
        value.clone()
    }
}

/// A cluster's nodes, `ID=HOST:PORT` items separated by spaces or commas (a TOML array of such
/// strings too); checked item by item in `Config::cluster_peers`.
pub(super) struct Peers;

impl Kind for Peers {
    type Value = Option<Vec<String>>;
    fn expecting() -> String {
        "a list of nodes such as [\"1=10.0.0.1:9278\", \"2=10.0.0.2:9278\"] or \"1=a:9278,2=b:9278\"".into()
    }
    fn parse(text: &str) -> Result<Option<Vec<String>>, String> {
        let items: Vec<String> =
            text.split([' ', ',']).filter(|h| !h.is_empty()).map(str::to_string).collect();
        if items.is_empty() {
            return Err("must name at least one node; leave peers unset for a single node".into());
        }
        Ok(Some(items))
    }
    fn show(value: &Option<Vec<String>>) -> Option<String> {
        value.as_ref().map(|items| items.join(" "))
    }
    fn from_toml(value: &toml::Value) -> Result<Option<Vec<String>>, String> {
        list_from_toml::<Self>(value)
    }
}
