//! Test TLS material made with the `openssl` CLI: a CA, a server certificate
//! for `127.0.0.1` and `localhost` signed by it, and an unrelated CA. The
//! server certificate is not the CA itself because rustls refuses a CA
//! certificate presented as the server's own (`CaUsedAsEndEntity`), which is
//! what a lone `openssl req -x509` makes.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::BoxError;

/// Files written by [`test_certs`], all PEM.
#[derive(Debug, Clone)]
pub struct TestCerts {
    /// The CA that signed the server certificate.
    pub ca: PathBuf,
    /// The server certificate (for 127.0.0.1 and localhost).
    pub cert: PathBuf,
    /// The server key.
    pub key: PathBuf,
    /// A second CA that signed nothing the server presents.
    pub other_ca: PathBuf,
}

impl TestCerts {
    /// The CA certificate's PEM bytes, for clients that take them inline.
    ///
    /// # Errors
    ///
    /// If the file cannot be read.
    pub fn ca_pem(&self) -> Result<Vec<u8>, BoxError> {
        Ok(std::fs::read(&self.ca)?)
    }
}

/// Writes `<stem>-ca.pem`, `<stem>.pem` with `<stem>-key.pem`, and
/// `<stem>-other-ca.pem` (plus their keys and a CSR) into `dir`, valid for
/// one day.
///
/// # Errors
///
/// If `openssl` is missing or fails.
pub fn test_certs(dir: &Path, stem: &str) -> Result<TestCerts, BoxError> {
    let p = |suffix: &str| dir.join(format!("{stem}{suffix}"));
    let s = |path: PathBuf| path.to_string_lossy().into_owned();
    for ca in ["-ca", "-other-ca"] {
        openssl(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            &format!("/CN=lock-test{ca}-{stem}"),
            "-keyout",
            &s(p(&format!("{ca}-key.pem"))),
            "-out",
            &s(p(&format!("{ca}.pem"))),
        ])?;
    }
    openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=localhost",
        "-keyout",
        &s(p("-key.pem")),
        "-out",
        &s(p(".csr")),
    ])?;
    std::fs::write(
        p(".ext"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n",
    )?;
    openssl(&[
        "x509",
        "-req",
        "-in",
        &s(p(".csr")),
        "-CA",
        &s(p("-ca.pem")),
        "-CAkey",
        &s(p("-ca-key.pem")),
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        &s(p(".ext")),
        "-out",
        &s(p(".pem")),
    ])?;
    Ok(TestCerts {
        ca: p("-ca.pem"),
        cert: p(".pem"),
        key: p("-key.pem"),
        other_ca: p("-other-ca.pem"),
    })
}

fn openssl(args: &[&str]) -> Result<(), BoxError> {
    let out = Command::new("openssl")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run openssl (apt-get install openssl): {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "openssl {} failed: {}",
            args.first().unwrap_or(&""),
            String::from_utf8_lossy(&out.stderr)
        )
        .into())
    }
}
