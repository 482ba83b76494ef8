//! Settings: their types, defaults and validation, and the config file that
//! sets them. Pure: nothing here touches the host or the kernel.

pub mod defaults;
pub mod ejection;
pub mod file;
pub mod hedge;
pub mod resolv_conf;
pub mod settings;
pub mod tunables;
