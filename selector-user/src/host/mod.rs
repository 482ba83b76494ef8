//! The host around the programs: interfaces, neighbours and routes (netlink),
//! network namespaces, kernel features, tc filters, shared memory and raw
//! syscalls.

pub mod interface;
pub mod neighbours;
pub mod netns;
pub mod preflight;
pub mod route_events;
pub mod shared;
pub mod stdout;
pub mod sys;
pub mod tc_attach;
pub mod tcx;
