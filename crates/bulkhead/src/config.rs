//! `--config FILE`: an optional TOML file of flag values.
//!
//! Keys are the long flag names of the command being run (`kv-pool-tokens` or
//! `kv_pool_tokens`). Precedence: command line, then environment variable, then the file,
//! then the built-in default. The file is applied by adding the missing flags to the command
//! line before clap parses it, so every flag clap knows is configurable and validated the
//! same way, and an unknown key is an error rather than silently ignored.

use std::ffi::OsString;
use std::path::Path;

use anyhow::{Context, bail};
use clap::Command;

/// The command line with the values from the config file (if one is named by `--config`
/// or `BULKHEAD_CONFIG`) added for every flag that neither the command line nor the
/// environment sets.
pub fn apply(cmd: &Command, args: Vec<OsString>) -> anyhow::Result<Vec<OsString>> {
    let Some(path) = config_path(&args) else { return Ok(args) };
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read the config file {}", path.display()))?;
    let table: toml::Table = text.parse().with_context(|| format!("config file {} is not valid TOML", path.display()))?;
    // The subcommand is the first argument clap would take as one.
    let Some(sub) = args.iter().skip(1).filter_map(|a| a.to_str()).find_map(|a| cmd.find_subcommand(a)) else {
        return Ok(args);
    };
    let mut out = args.clone();
    for (key, value) in &table {
        let name = key.replace('_', "-");
        let Some(arg) = sub.get_arguments().find(|a| a.get_long() == Some(name.as_str())) else {
            let valid: Vec<&str> = sub.get_arguments().filter_map(|a| a.get_long()).filter(|l| *l != "config").collect();
            bail!("config file {}: unknown key `{key}` for `{}` (valid keys: {})", path.display(), sub.get_name(), valid.join(", "));
        };
        let flag = format!("--{name}");
        let on_command_line = args.iter().filter_map(|a| a.to_str()).any(|a| a == flag || a.starts_with(&format!("{flag}=")));
        let in_env = arg.get_env().is_some_and(|e| std::env::var_os(e).is_some());
        if on_command_line || in_env {
            continue;
        }
        match value {
            toml::Value::Boolean(true) => out.push(flag.into()),
            toml::Value::Boolean(false) => {}
            toml::Value::String(s) => out.extend([flag.into(), s.into()]),
            toml::Value::Integer(i) => out.extend([flag.into(), i.to_string().into()]),
            toml::Value::Float(f) => out.extend([flag.into(), f.to_string().into()]),
            toml::Value::Array(items) => {
                let parts: Vec<String> = items.iter().map(scalar).collect::<anyhow::Result<_>>()?;
                out.extend([flag.into(), parts.join(",").into()]);
            }
            other => {
                bail!("config file {}: key `{key}` has a {} value; use a string, number, boolean or list", path.display(), other.type_str())
            }
        }
    }
    Ok(out)
}

fn scalar(v: &toml::Value) -> anyhow::Result<String> {
    match v {
        toml::Value::String(s) => Ok(s.clone()),
        toml::Value::Integer(i) => Ok(i.to_string()),
        toml::Value::Float(f) => Ok(f.to_string()),
        toml::Value::Boolean(b) => Ok(b.to_string()),
        other => bail!("a list in the config file holds a {}", other.type_str()),
    }
}

/// `--config FILE`, `--config=FILE`, else `BULKHEAD_CONFIG`.
fn config_path(args: &[OsString]) -> Option<std::path::PathBuf> {
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let Some(s) = a.to_str() else { continue };
        if s == "--config" {
            return it.next().map(|p| Path::new(p).to_path_buf());
        }
        if let Some(p) = s.strip_prefix("--config=") {
            return Some(p.into());
        }
    }
    std::env::var_os("BULKHEAD_CONFIG").map(Into::into)
}

/// The configuration reference (docs/CONFIG.md), generated from the CLI definition so it
/// cannot drift: one table per subcommand with flag, environment variable, default and help.
pub fn reference(cmd: &Command) -> String {
    let mut out = String::from(
        "# Configuration reference\n\n\
         Generated from the command-line definition by `bulkhead config-reference`; a test fails when\n\
         this file and the CLI differ (regenerate with\n\
         `cargo run -p bulkhead -- config-reference > docs/CONFIG.md`).\n\n\
         Every flag can also be set by its environment variable, or by its long name as a key in a\n\
         TOML file named by `--config FILE` (or `BULKHEAD_CONFIG`): `kv-pool-tokens = 4096`.\n\
         The command line wins over the environment, which wins over the file.\n",
    );
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        out.push_str(&format!("\n## `bulkhead {}`\n\n", sub.get_name()));
        if let Some(about) = sub.get_about() {
            out.push_str(&format!("{about}\n\n"));
        }
        out.push_str("| flag | environment | default | description |\n|---|---|---|---|\n");
        for a in sub.get_arguments().filter(|a| !a.is_hide_set() && a.get_id() != "help") {
            let flag = match (a.get_long(), a.is_positional()) {
                (_, true) => format!("`<{}>`", a.get_id().as_str().to_uppercase()),
                (Some(l), false) => format!("`--{l}`"),
                (None, false) => continue,
            };
            let env = a.get_env().map_or("".into(), |e| format!("`{}`", e.to_string_lossy()));
            let default: Vec<String> = a.get_default_values().iter().map(|v| v.to_string_lossy().into_owned()).collect();
            let help = a.get_help().map_or(String::new(), |h| h.to_string().replace('\n', " ").replace('|', "\\|"));
            out.push_str(&format!("| {flag} | {env} | {} | {help} |\n", default.join(",")));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Arg, ArgAction};

    fn cmd() -> Command {
        Command::new("bulkhead").subcommand(
            Command::new("serve")
                .arg(Arg::new("port").long("port").env("BULKHEAD_TEST_CONFIG_PORT"))
                .arg(Arg::new("kv-pool-tokens").long("kv-pool-tokens"))
                .arg(Arg::new("audit-kv").long("audit-kv").action(ArgAction::SetTrue))
                .arg(Arg::new("batches").long("batches"))
                .arg(Arg::new("config").long("config")),
        )
    }

    fn run(file: &str, cli: &[&str]) -> anyhow::Result<Vec<String>> {
        let dir = std::env::temp_dir().join(format!("bulkhead-config-{}-{}", std::process::id(), file.len()));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join("c.toml");
        std::fs::write(&path, file)?;
        let mut args: Vec<OsString> = ["bulkhead", "serve", "--config"].iter().map(Into::into).collect();
        args.push(path.clone().into());
        args.extend(cli.iter().map(Into::into));
        let out = apply(&cmd(), args)?;
        Ok(out.into_iter().skip(4).map(|a| a.to_string_lossy().into_owned()).collect())
    }

    #[test]
    fn file_values_fill_in_only_what_the_command_line_leaves_unset() {
        let out = run("kv_pool_tokens = 4096\naudit-kv = true\nport = 9000\nbatches = [1, 4]\n", &["--port", "8081"]).unwrap();
        // Keys apply in the file's sorted order; `port` is on the command line already.
        assert_eq!(out, ["--port", "8081", "--audit-kv", "--batches", "1,4", "--kv-pool-tokens", "4096"]);
    }

    #[test]
    fn unknown_keys_and_bad_toml_are_errors_that_name_the_problem() {
        let e = run("kv_pool_tokes = 1\n", &[]).unwrap_err().to_string();
        assert!(e.contains("unknown key `kv_pool_tokes`") && e.contains("kv-pool-tokens"), "{e}");
        let e = run("port = \n", &[]).unwrap_err().to_string();
        assert!(e.contains("not valid TOML"), "{e}");
        let e = run("[port]\nx = 1\n", &[]).unwrap_err().to_string();
        assert!(e.contains("table value"), "{e}");
    }
}
