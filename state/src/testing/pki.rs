//! Certificates for TLS tests, made on the spot with rcgen: a CA, a server
//! certificate for `127.0.0.1`/`localhost` and a client certificate, as PEM files.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, ExtendedKeyUsagePurpose, IsCa, KeyPair,
};

/// PEM files of a CA, a server certificate it signed (for 127.0.0.1 and localhost)
/// and a client certificate it signed; removed when dropped.
#[derive(Debug)]
pub struct Pki {
    _dir: tempfile::TempDir,
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

fn write(dir: &Path, name: &str, pem: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, pem).expect("write PEM");
    path
}

fn leaf(
    names: &[&str],
    usage: ExtendedKeyUsagePurpose,
    ca: &CertifiedIssuer<'_, KeyPair>,
) -> (String, String) {
    let key = KeyPair::generate().expect("key");
    let mut params =
        CertificateParams::new(names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>())
            .expect("params");
    params.extended_key_usages = vec![usage];
    let cert = params.signed_by(&key, ca).expect("sign");
    (cert.pem(), key.serialize_pem())
}

impl Pki {
    /// A fresh CA and the certificates it signed (each call an unrelated CA).
    ///
    /// # Panics
    /// If the files cannot be written (a test helper).
    pub fn generate() -> Pki {
        let dir = tempfile::tempdir().expect("dir");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca =
            CertifiedIssuer::self_signed(params, KeyPair::generate().expect("key")).expect("ca");
        let (server_cert, server_key) = leaf(
            &["127.0.0.1", "localhost"],
            ExtendedKeyUsagePurpose::ServerAuth,
            &ca,
        );
        let (client_cert, client_key) = leaf(&["iadeep"], ExtendedKeyUsagePurpose::ClientAuth, &ca);
        Pki {
            ca: write(dir.path(), "ca.pem", &ca.pem()),
            server_cert: write(dir.path(), "server.pem", &server_cert),
            server_key: write(dir.path(), "server.key", &server_key),
            client_cert: write(dir.path(), "client.pem", &client_cert),
            client_key: write(dir.path(), "client.key", &client_key),
            _dir: dir,
        }
    }

    /// The PEM text of one of the files.
    ///
    /// # Panics
    /// If it cannot be read (a test helper).
    pub fn read(path: &Path) -> Vec<u8> {
        std::fs::read(path).expect("read PEM")
    }
}
