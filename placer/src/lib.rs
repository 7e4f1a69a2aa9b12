//! Placement service (issue: "Placement service").
//!
//! Not implemented yet: this crate exists so the workspace layout of DESIGN.md is
//! in place. It exports nothing, so nothing can mistake it for a working placer.
