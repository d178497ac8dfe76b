//! The edge: the one room where untrusted input enters the updater (docs/security.md).
//!
//! A hook request is a pointer, never an authority: any pod of the management cluster can
//! POST one, and a tenant who can create Machines, Secrets and Clusters in a namespace writes
//! most of what it points at. Everything that decides what a node does is read here from
//! objects only the right party can write, live, bounded and validated, and leaves this room
//! as a type whose constructor only this room can call:
//!
//! - [`kubeconfig`]: a workload cluster's kubeconfig Secret → credentials that are data only
//!   (server, CA, inline client certificate and key or token), never code or a file path.
//! - [`yaml`]: bootstrap data, Ignition and hook request bodies → documents parsed under
//!   size, depth, node-count and scalar-byte limits (an alias counted as what it expands to).
//! - [`agent_ca`]: the CA that may verify a Machine's agent and the identity the agent must
//!   present → a peer bound to the Machine's own cluster, made only under effective settings.
//! - [`extension_config`]: the operator's ExtensionConfig that selects the Machine's
//!   namespace → the effective settings (a request's own `settings` only point at them).
//!
//! Architecture invariant: code outside this module cannot build these types from raw input;
//! it accepts them as arguments.

pub mod agent_ca;
pub mod extension_config;
pub mod kubeconfig;
pub mod yaml;
