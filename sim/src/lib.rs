//! Trace-driven cluster simulator (issue: "Trace-driven cluster simulator").
//!
//! Not implemented yet: this crate exists so the workspace layout of DESIGN.md is
//! in place. It exports nothing, so nothing can mistake it for a working simulator.
