//! Agent SDK for training loops (issue: "Agent SDK").
//!
//! Not implemented yet: this crate exists so the workspace layout of DESIGN.md is
//! in place. It exports nothing, so nothing can mistake it for a working agent.
