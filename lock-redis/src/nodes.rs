//! The `redis+cluster://` URL form: credentials and a list of seed nodes.

use lock_core::BackendError;
use redis::IntoConnectionInfo;

use crate::error::config;

/// The port cluster nodes listen on unless the URL says otherwise.
const DEFAULT_PORT: u16 = 6379;

/// What a `redis+cluster://` URL holds (and a `redis+sentinel://` URL's
/// sentinels and credentials).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ClusterUrl {
    pub(crate) nodes: Vec<(String, u16)>,
    pub(crate) username: Option<String>,
    pub(crate) password: Option<String>,
}

/// `h1:p1,h2:p2`: the seed nodes, without credentials, for messages.
pub(crate) fn shown(nodes: &[(String, u16)]) -> String {
    let hosts: Vec<String> = nodes
        .iter()
        .map(|(h, p)| {
            if h.contains(':') {
                format!("[{h}]:{p}")
            } else {
                format!("{h}:{p}")
            }
        })
        .collect();
    hosts.join(",")
}

/// Parses what follows `redis+cluster://`:
/// `[user[:password]@]host1[:port1][,host2[:port2]...][/[0]]`.
/// `shown_url` is the URL with its credentials masked, for messages.
pub(crate) fn parse_cluster(rest: &str, shown_url: &str) -> Result<ClusterUrl, BackendError> {
    let bad = |why: &str| config(format!("malformed Redis Cluster URL {shown_url}: {why}"));
    if rest.contains('?') {
        return Err(bad("query parameters are not supported"));
    }
    let (authority, path) = match rest.split_once('/') {
        Some((a, p)) => (a, p),
        None => (rest, ""),
    };
    if !matches!(path, "" | "0") {
        return Err(bad(
            "a cluster has only database 0; expected nothing or /0 after the nodes",
        ));
    }
    parse_authority(authority, DEFAULT_PORT, "node", &bad)
}

/// Parses `[user[:password]@]host1[:port1][,host2[:port2]...]`, the part of
/// a Sentinel or Cluster URL before its path, each port `default_port`
/// unless given. `what` names a host in messages; `bad` words the error.
pub(crate) fn parse_authority(
    authority: &str,
    default_port: u16,
    what: &str,
    bad: &dyn Fn(&str) -> BackendError,
) -> Result<ClusterUrl, BackendError> {
    let (userinfo, hosts) = match authority.rsplit_once('@') {
        Some((u, h)) => (Some(u), h),
        None => (None, authority),
    };
    let mut nodes = Vec::new();
    for host in hosts.split(',') {
        nodes.push(parse_host(host, default_port).ok_or_else(|| {
            bad(&format!(
                "each {what} must be host or host:port (IPv6 in brackets), separated by commas"
            ))
        })?);
    }
    // The redis client's own parser decodes the percent-encoded credentials,
    // so they read exactly as in a redis:// URL.
    let (username, password) = match userinfo {
        None => (None, None),
        Some(u) => {
            let info = format!("redis://{u}@127.0.0.1/")
                .into_connection_info()
                .map_err(|_| bad("the user name or password does not parse"))?;
            let s = info.redis_settings();
            (
                s.username().map(str::to_owned),
                s.password().map(str::to_owned),
            )
        }
    };
    Ok(ClusterUrl {
        nodes,
        username,
        password,
    })
}

/// `host`, `host:port`, `[v6]` or `[v6]:port`; `None` when malformed.
fn parse_host(host: &str, default_port: u16) -> Option<(String, u16)> {
    let (name, port) = if let Some(v6) = host.strip_prefix('[') {
        let (name, after) = v6.split_once(']')?;
        let port = match after {
            "" => None,
            p => Some(p.strip_prefix(':')?),
        };
        (name, port)
    } else {
        match host.split_once(':') {
            Some((name, port)) => (name, Some(port)),
            None => (host, None),
        }
    };
    if name.is_empty() || name.contains(['@', '/', '[', ']']) {
        return None;
    }
    let port = match port {
        None => default_port,
        Some(p) => p.parse().ok().filter(|p| *p != 0)?,
    };
    Some((name.to_owned(), port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_and_credentials_parse() -> Result<(), BackendError> {
        let p = parse_cluster("u:p%40ss@h1:7000,h2,[::1]:7002", "x")?;
        assert_eq!(
            p.nodes,
            vec![
                ("h1".to_owned(), 7000),
                ("h2".to_owned(), DEFAULT_PORT),
                ("::1".to_owned(), 7002)
            ]
        );
        assert_eq!(p.username.as_deref(), Some("u"));
        assert_eq!(p.password.as_deref(), Some("p@ss"));
        assert_eq!(shown(&p.nodes), "h1:7000,h2:6379,[::1]:7002");
        let q = parse_cluster("h1:1/0", "x")?;
        assert_eq!((q.username, q.password), (None, None));
        Ok(())
    }

    #[test]
    fn malformed_cluster_urls_are_refused() {
        for rest in [
            "",
            "h1:x",
            "h1:0",
            "h1:1,,h2:2",
            "h1:1/2",
            "h1:1/0/x",
            "h1:1?x=1",
            "[::1:1",
            ":pw@",
        ] {
            assert!(parse_cluster(rest, "shown").is_err(), "{rest:?}");
        }
    }
}
