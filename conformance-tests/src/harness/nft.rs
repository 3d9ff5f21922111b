//! nftables tables on loopback that the fault cases create and delete.

use std::process::Command;

use super::which;
use crate::BoxError;

/// Whether `nft` is installed.
pub fn installed() -> bool {
    which("nft").is_some() || std::path::Path::new("/usr/sbin/nft").is_file()
}

/// Runs `nft` with `args`; its stderr on failure.
pub fn nft(args: &[&str]) -> Result<(), BoxError> {
    let program = which("nft").unwrap_or_else(|| "/usr/sbin/nft".into());
    let out = Command::new(program).args(args).output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "nft {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        )
        .into())
    }
}

/// An `inet` table with one `output` filter chain, deleted when dropped.
/// Every packet on loopback passes the output hook once, so one chain sees
/// both directions of a connection.
#[derive(Debug)]
pub struct OutputTable {
    name: String,
}

impl OutputTable {
    /// Creates table `name` (deleting a leftover of the same name first)
    /// with the given rules, each a list of nft words, in order.
    pub fn create(name: &str, rules: &[Vec<String>]) -> Result<Self, BoxError> {
        let _ = nft(&["delete", "table", "inet", name]);
        nft(&["add", "table", "inet", name])?;
        let table = Self {
            name: name.to_owned(),
        };
        nft(&[
            "add",
            "chain",
            "inet",
            name,
            "output",
            "{ type filter hook output priority 0 ; }",
        ])?;
        for rule in rules {
            let mut args = vec!["add", "rule", "inet", name, "output"];
            args.extend(rule.iter().map(String::as_str));
            nft(&args)?;
        }
        Ok(table)
    }
}

impl Drop for OutputTable {
    fn drop(&mut self) {
        let _ = nft(&["delete", "table", "inet", &self.name]);
    }
}
