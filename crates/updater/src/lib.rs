//! The updater: the Cluster API Runtime Extension (`inplace-updater`) that answers
//! `CanUpdateMachine`, `CanUpdateMachineSet` and `UpdateMachine`, turns the desired Machine
//! and KubeadmConfig into an inplace-agent plan and drives the node's agent over its mutual
//! TLS gRPC API. docs/updater.md is the guide for people.
//!
//! ```text
//! CAPI ──POST hook──► server (HTTPS) ──► handlers ──► translate / patch (pure)
//!                                          │  cluster: live Machine, KubeadmConfig, Secrets (kube-rs)
//!                                          ▼
//!                                        agent: GetNodeInfo, CheckPlan, GetPlanStatus, ApplyPlan
//!                                          └──► the plan status's hookResponse, back to CAPI
//! ```
//!
//! - [`hooks`]: the wire types (requests checked field by field, responses in CAPI's order).
//! - [`translate`]: desired objects → plan document → validated [`inplace_plan::Plan`].
//! - [`bootstrap_data`]: the user files a Machine's bootstrap data wrote (CABPK's own left
//!   out), so a file dropped from `files[]` is removed although no plan wrote it.
//! - [`patch`]: what is covered in place and the JSON Patches that say so.
//! - [`settings`]: the ExtensionConfig's `settings`.
//! - [`handlers`]: the hooks; [`server`]: HTTPS, routing, limits; [`metrics`].
//! - [`cluster`]: the management cluster (kube-rs); [`agent`]: the agents (gRPC client pool).
//! - [`trust`]: which CA verifies a Machine's agent (the fleet's, or its cluster's).
//! - [`progress`]: what the agents last said about each Machine's plan, kept between calls.
//! - [`recovery`]: a failed plan as an Event on its Machine, and its retry by annotation.
//! - [`unreachable`]: an agent that does not answer: Events, a deadline, then Failure.
//! - [`drain`]: the drain before a disruptive plan (pure); [`workload`]: the workload
//!   cluster's Node, Pods and Evictions (kube-rs, from the `<cluster>-kubeconfig` Secret).
//! - `drift`: a node that drifted from its succeeded plan is repaired, not answered done.
//! - [`why`]: why an answer is not everything in place; [`events`]: it, as an Event;
//!   [`explain`]: it, before a change is applied.
//! - [`standin`]: a STAND-IN Kubernetes API for tests, the demo and the benchmark.
//!
//! Architecture invariant: the updater is a client of the agent's API (`inplace_api`) and of
//! the plan model (`inplace_plan`); its crate does not depend on the agent's (the compiler
//! holds it; tests/it/architecture.rs checks the dependency graph). It keeps no durable state
//! of its own: the plan id is derived from the desired specs and the agent's journal is the
//! truth about progress, so any replica answers any call and a restarted updater answers as
//! before. What must outlive a call is written where every replica reads it: for a failed
//! plan ([`recovery`]) an Event on the Machine and the record of a retry it acted on, an
//! annotation of the Machine; for an agent that does not answer ([`unreachable`]) Events and
//! when the wait began, an annotation of the Machine; for a drain ([`drain`]) the cordon and
//! the plan that cordoned, on the workload cluster's Node. What it remembers ([`progress`]:
//! the agents' last word on each Machine's plan, pushed by their `WatchPlan` streams) only
//! saves round trips.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub(crate) mod agent;
pub mod bootstrap_data;
pub mod cli;
pub(crate) mod cluster;
pub mod deadlines;
pub(crate) mod demo;
pub mod drain;
pub(crate) mod drift;
pub mod edge;
pub mod emulate;
pub(crate) mod errors;
pub(crate) mod events;
pub mod explain;
pub mod handlers;
pub mod hooks;
pub(crate) mod metrics;
pub mod pace;
pub mod patch;
pub(crate) mod progress;
pub(crate) mod recovery;
pub(crate) mod server;
pub mod settings;
pub(crate) mod setup;
pub mod skew;
pub mod standin;
pub mod translate;
pub mod unreachable;
pub mod why;
pub mod workload;

pub use cluster::MAX_LISTED;

/// The updater's version and the commit it was built from (`inplace-updater version`).
pub const BUILD: inplace_base::build::Build = inplace_base::build!();
