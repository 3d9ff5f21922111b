//! The inputs: passwords with every awkward character, placed in every
//! position a connection string can carry one, for every backend's syntax.

/// Every password is made of tokens that start with this marker, so a
/// fragment of one (a parser that split it at `/` or `@`) is as easy to find
/// in an error text as the whole.
pub(crate) const MARKER: &str = "zqk";

/// Passwords as a user would type them: plain, base64 with `/`, each of
/// `/ ? # @ :` and `& = , ; % ' \` and a space, and already percent-encoded.
pub(crate) const PASSWORDS: &[&str] = &[
    "zqka",
    "zqka/zqkb+zqkc==",
    "zqka?zqkb",
    "zqka#zqkb",
    "zqka@zqkb",
    "zqka:zqkb",
    "zqka/zqkb?zqkc#zqkd@zqke:zqkf",
    "zqka%2Fzqkb%40zqkc%3Azqkd%23zqke%3Fzqkf",
    "zqka%zqkb",
    "zqka&zqkb=zqkc",
    "zqka,zqkb;zqkc",
    "zqka zqkb",
    "zqka'zqkb\\zqkc",
];

/// One input and what a correct parse of it may show.
#[derive(Debug, Clone)]
pub(crate) struct Case {
    /// The URL, endpoint or key=value string.
    pub input: String,
    /// The password sits where a parser reads a user name (`scheme://PW@host`):
    /// errors must still hide it, but a parsed configuration may show it as
    /// the user name it is.
    pub user_position: bool,
}

/// Percent-encodes everything but RFC 3986's unreserved characters.
pub(crate) fn encode(raw: &str) -> String {
    let mut out = String::new();
    for byte in raw.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// Quotes a value for a libpq key=value string.
fn quote(raw: &str) -> String {
    format!("'{}'", raw.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// URL templates: `{s}` is the scheme, `{pw}` the password, `{port}` a
/// closed local port (a URL that parses leads to a quick refusal there).
const REDIS: &[&str] = &[
    "{s}://u:{pw}@127.0.0.1:{port}/0",
    "{s}://:{pw}@127.0.0.1:{port}",
    "{s}://u:{pw}@h:x/0",
    "{s}://u:{pw}@h:6379/notadb",
    "{s}://u:{pw}@h:6379/0#frag",
    "{s}://u:{pw}@h:6379/0?protocol=bogus",
    "{s}://127.0.0.1:{port}/0?password={pw}",
    "{s}://h:x/0?password={pw}&pass={pw}",
];
const POSTGRES: &[&str] = &[
    "{s}://u:{pw}@127.0.0.1:{port}/db",
    "{s}://u:{pw}@h:x/db",
    "{s}://u:{pw}@h/db?sslmode=bogus",
    "{s}://u:{pw}@h/db?bogus_param=1",
    "{s}://u@127.0.0.1:{port}/db?password={pw}",
    "{s}://u@h:x/db?password={pw}",
    "{s}://u@h/db?sslmode=bogus&sslpassword={pw}",
    "{s}://u@h/db?bogus=1&password={pw}",
];
const ETCD: &[&str] = &[
    "{s}://u:{pw}@127.0.0.1:{port}",
    "{s}://u:{pw}@h:x",
    "{s}://u:{pw}@h:2379,h2:notaport",
    "{s}://u:{pw}@h:2379?token={pw}",
];
const HTTP: &[&str] = &[
    "{s}://u:{pw}@127.0.0.1:{port}",
    "{s}://u:{pw}@h:2379",
    "{s}://h:2379?token={pw}",
    "{s}://h:2379/?secret={pw}",
];
/// Templates without a scheme: a bare etcd endpoint and libpq key=value strings.
const BARE: &[&str] = &[
    "u:{pw}@h:2379",
    "u:{pw}@127.0.0.1:{port}",
    "host=127.0.0.1 port={port} user=u password={pw}",
    "password={pw} host=h port=x",
    "host=h port=x user=u password={quoted} dbname=db",
];
/// The password where a parser reads a user name.
const USER_POSITION: &[&str] = &["{s}://{pw}@127.0.0.1:{port}", "{s}://{pw}@h:x"];

const SCHEMES: &[(&[&str], &[&str])] = &[
    (REDIS, &["redis", "rediss"]),
    (POSTGRES, &["postgres", "postgresql"]),
    (ETCD, &["etcd", "etcds"]),
    (HTTP, &["http", "https"]),
    (
        USER_POSITION,
        &[
            "redis",
            "rediss",
            "postgres",
            "postgresql",
            "etcd",
            "etcds",
            "http",
        ],
    ),
];

/// Every template × scheme × password, each password once as typed and
/// once percent-encoded.
pub(crate) fn cases(port: u16) -> Vec<Case> {
    let mut out = Vec::new();
    let fill = |template: &str, scheme: &str, pw: &str, raw: &str| {
        template
            .replace("{s}", scheme)
            .replace("{port}", &port.to_string())
            .replace("{quoted}", &quote(raw))
            .replace("{pw}", pw)
    };
    for raw in PASSWORDS {
        for pw in [raw.to_string(), encode(raw)] {
            for (templates, schemes) in SCHEMES {
                let user_position = std::ptr::eq(*templates, USER_POSITION);
                // `scheme://a:b@host` names user `a` with password `b`, and
                // user names may be shown: only a password without `:` can
                // stand in the user's place.
                if user_position && pw.contains(':') {
                    continue;
                }
                for template in *templates {
                    for scheme in *schemes {
                        out.push(Case {
                            input: fill(template, scheme, &pw, raw),
                            user_position,
                        });
                    }
                }
            }
            for template in BARE {
                out.push(Case {
                    input: fill(template, "", &pw, raw),
                    user_position: false,
                });
            }
        }
    }
    out
}
