//! Empty library target: lets selector-user name this crate as a
//! build-dependency, so cargo rebuilds the kernel object when it changes.
#![no_std]
