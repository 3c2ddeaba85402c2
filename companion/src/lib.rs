//! MaaS companion (skeleton).
