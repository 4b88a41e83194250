//! The command line: `--config FILE` and one flag per key, each listed by `--help` with its
//! environment variable and its default.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::parser::ValueSource;
use clap::{value_parser, Arg, ArgMatches, Command};

use super::{env_var, flag, Config, CONFIG_ENV_VAR, KEY_TABLE};

const AFTER_HELP: &str = "\
Sources, each overriding the one before: built-in defaults < --config FILE (or DELAYD_CONFIG) <
DELAYD_* environment variables < flags. A DELAYD_* variable that looks like a misspelt setting, an
unknown key in the file or a bad value stops the start with a message naming it (exit code 2); other
DELAYD_* variables (a script's DELAYD_BIN, delayd-cli's DELAYD_URL) are ignored, with a warning.
Durations: 500ms, 10s, 1h30m, 2d or a plain number of milliseconds. Sizes: 4MB (4,000,000 bytes),
4MiB (4,194,304 bytes) or a plain number of bytes. Lists: \"1s 5s 1m\" (spaces or commas).
delayd runs on Linux only.";

/// What the command line says: the config file, and the keys given as flags.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Cli {
    /// TOML config file.
    pub config: Option<PathBuf>,
    /// Keys given as flags, as `(key, value)`, in the order of [`super::KEYS`].
    pub flags: Vec<(&'static str, String)>,
}

impl Cli {
    /// The command-line definition; defaults shown in `--help` come from [`Config::default`].
    pub fn command() -> Command {
        let defaults = Config::default();
        let config = Arg::new("config")
            .long("config")
            .short('c')
            .value_name("FILE")
            .value_parser(value_parser!(PathBuf))
            // Shown in --help; `Config::load` reads the variable itself, like every other one.
            .env(CONFIG_ENV_VAR)
            .help("TOML config file; config/delayd.toml documents every key");
        let mut cmd = Command::new("delayd")
            .version(env!("CARGO_PKG_VERSION"))
            .about("A durable delay-message broker over HTTP")
            .after_help(AFTER_HELP)
            .arg(config);
        for key in KEY_TABLE {
            let long = flag(key.name);
            // clap reads the variable too, but only for the help line: `Config::load` reads the
            // environment itself, so an unknown DELAYD_* name is caught in one place and tests can
            // hand it an environment of their own. Values clap took from it are ignored below.
            let mut arg = Arg::new(key.name)
                .long(long.trim_start_matches('-').to_string())
                .value_name(key.value_name)
                .help(key.help)
                .env(env_var(key.name));
            if let Some(default) = defaults.get(key.name) {
                arg = arg.default_value(default);
            }
            if key.secret {
                arg = arg.hide_env_values(true);
            }
            cmd = cmd.arg(arg);
        }
        cmd
    }

    /// Parses the process's arguments; for `--help`, `--version` or a usage error clap prints and
    /// exits (with code 2 for an error).
    pub fn parse() -> Cli {
        Cli::from_matches(&Cli::command().get_matches())
    }

    /// Parses `args`, the first being the program name.
    pub fn try_parse_from<I, T>(args: I) -> Result<Cli, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString> + Clone,
    {
        Ok(Cli::from_matches(&Cli::command().try_get_matches_from(args)?))
    }

    fn from_matches(m: &ArgMatches) -> Cli {
        // Defaults and environment values clap filled in are not flags: the file must still be able
        // to override a default, and the environment is read by `Config::load`.
        let flags = KEY_TABLE
            .iter()
            .filter(|key| m.value_source(key.name) == Some(ValueSource::CommandLine))
            .filter_map(|key| m.get_one::<String>(key.name).map(|v| (key.name, v.clone())))
            .collect();
        let config = (m.value_source("config") == Some(ValueSource::CommandLine))
            .then(|| m.get_one::<PathBuf>("config").cloned())
            .flatten();
        Cli { config, flags }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::KEYS;

    #[test]
    fn flags_are_taken_defaults_are_not() {
        let cli =
            Cli::try_parse_from(["delayd", "-c", "d.toml", "--max-delay", "1h", "--flush", "async"]).unwrap();
        assert_eq!(cli.config, Some(PathBuf::from("d.toml")));
        assert_eq!(cli.flags, vec![("flush", "async".to_string()), ("max_delay", "1h".to_string())]);
        assert_eq!(Cli::try_parse_from(["delayd"]).unwrap(), Cli::default());
        let cli = Cli::try_parse_from(["delayd", "--auth-token="]).unwrap();
        assert_eq!(cli.flags, vec![("auth_token", String::new())]);
    }

    #[test]
    fn only_the_secrets_are_kept_out_of_help() {
        let secret: Vec<&str> = KEY_TABLE.iter().filter(|k| k.secret).map(|k| k.name).collect();
        assert_eq!(secret, ["auth_token", "read_token", "cluster_secret"]);
        for name in secret {
            let arg = Cli::command().get_arguments().find(|a| a.get_id() == name).cloned().unwrap();
            assert!(arg.is_hide_env_values_set(), "{name}");
        }
    }

    #[test]
    fn unknown_flags_are_usage_errors() {
        let e = Cli::try_parse_from(["delayd", "--max-dealy", "1h"]).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(e.to_string().contains("--max-delay"), "clap suggests the near flag: {e}");
    }

    #[test]
    fn help_shows_every_flag_with_its_variable_and_default() {
        let help = Cli::command().render_help().to_string();
        let defaults = Config::default();
        for key in KEYS {
            assert!(help.contains(&flag(key)), "{key}: {help}");
            assert!(help.contains(&env_var(key)), "{key}: {help}");
            if let Some(d) = defaults.get(key) {
                let shown = [format!("[default: {d}]"), format!("[default: {d:?}]")];
                assert!(shown.iter().any(|s| help.contains(s)), "{key}: {help}");
            }
        }
    }
}
