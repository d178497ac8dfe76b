//! `inplace-agent pki init`: a throwaway CA and certificates for trying the agent out.
//! Not for production (see docs/pki.md for cert-manager).

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Subcommand};

use super::Exit;
use inplace_api::pki::{DEFAULT_READER_IDENTITY, DEFAULT_UPDATER_IDENTITY, PkiInitOptions, init};

/// Arguments of `pki`.
#[derive(Debug, Args, Clone)]
pub struct PkiArgs {
    #[command(subcommand)]
    command: PkiCommand,
}

#[derive(Debug, Subcommand, Clone)]
enum PkiCommand {
    /// Write a throwaway CA, a server certificate for a node and updater and reader client
    /// certificates into DIR (NOT FOR PRODUCTION: the CA key stays next to them)
    Init(InitArgs),
}

#[derive(Debug, Args, Clone)]
struct InitArgs {
    /// Directory to write into (created with mode 0700)
    dir: PathBuf,
    /// The node's name, put into the server certificate
    #[arg(long)]
    node_name: String,
    /// URI SAN of the updater (admin) certificate
    #[arg(long, default_value = DEFAULT_UPDATER_IDENTITY)]
    updater_identity: String,
    /// URI SAN of the reader certificate
    #[arg(long, default_value = DEFAULT_READER_IDENTITY)]
    reader_identity: String,
    /// The workload cluster the node belongs to, NAMESPACE/NAME (its Cluster in the management
    /// cluster): adds the URI SAN spiffe://inplace-agent/cluster/NAMESPACE/NAME to the server
    /// certificate, which inplace-updater requires with agentCA: File (docs/pki.md)
    #[arg(long, value_name = "NAMESPACE/NAME", value_parser = parse_cluster)]
    cluster: Option<(String, String)>,
    /// Validity of the certificates, in days
    #[arg(long, default_value_t = 365, value_parser = clap::value_parser!(u64).range(1..=3650))]
    days: u64,
    /// Replace existing files
    #[arg(long)]
    overwrite: bool,
}

/// `--cluster NAMESPACE/NAME`.
fn parse_cluster(s: &str) -> Result<(String, String), String> {
    match s.split_once('/') {
        Some((namespace, name))
            if inplace_api::pki::is_object_name(namespace)
                && inplace_api::pki::is_object_name(name) =>
        {
            Ok((namespace.to_owned(), name.to_owned()))
        }
        _ => Err(format!(
            "{s:?} is not NAMESPACE/NAME of a Cluster (each a Kubernetes object name)"
        )),
    }
}

/// `inplace-agent pki`.
pub fn run(args: &PkiArgs) -> Exit {
    let PkiCommand::Init(a) = &args.command;
    let options = PkiInitOptions {
        updater_identity: a.updater_identity.clone(),
        reader_identity: a.reader_identity.clone(),
        validity: Duration::from_secs(a.days.saturating_mul(24 * 3600)),
        overwrite: a.overwrite,
        cluster: a.cluster.clone(),
        ..PkiInitOptions::new(&a.dir, &a.node_name)
    };
    match init(&options) {
        Ok(files) => {
            outln!(
                "wrote a throwaway PKI to {} (NOT FOR PRODUCTION: the CA key is kept next to the certificates; see docs/pki.md for cert-manager)",
                a.dir.display()
            );
            outln!(
                "  CA:      {} {}",
                files.ca_cert.display(),
                files.ca_key.display()
            );
            let bound = a
                .cluster
                .as_ref()
                .map(|(ns, name)| {
                    format!(", cluster {}", inplace_api::pki::cluster_identity(ns, name))
                })
                .unwrap_or_default();
            outln!(
                "  agent:   {} {} (node {}{bound})",
                files.server_cert.display(),
                files.server_key.display(),
                a.node_name
            );
            outln!(
                "  updater: {} {} (admin: {})",
                files.updater_cert.display(),
                files.updater_key.display(),
                a.updater_identity
            );
            outln!(
                "  reader:  {} {} (reader: {})",
                files.reader_cert.display(),
                files.reader_key.display(),
                a.reader_identity
            );
            outln!(
                "serve with: inplace-agent serve --node-name {} --tls-cert {} --tls-key {} --client-ca {} --admin {} --reader {}",
                a.node_name,
                files.server_cert.display(),
                files.server_key.display(),
                files.ca_cert.display(),
                a.updater_identity,
                a.reader_identity
            );
            Exit::Ok
        }
        Err(e) => {
            errln!("error: pki init {}: {e}", a.dir.display());
            Exit::Failed
        }
    }
}
