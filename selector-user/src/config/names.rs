//! Names on the wire and in the config file for the enums that have one,
//! and serde for them.

use selector_common::{Policy, TieBreak};

use crate::config::settings::OnOverload;

/// A name on the wire for the enums that have one (`Policy::name`, ...).
pub trait Named: Sized + Copy {
    /// What the name is of, for error messages.
    const WHAT: &'static str;
    fn name(self) -> &'static str;
    fn from_name(name: &str) -> Option<Self>;
}

impl Named for Policy {
    const WHAT: &'static str = "policy";
    fn name(self) -> &'static str {
        Policy::name(self)
    }
    fn from_name(name: &str) -> Option<Self> {
        Policy::from_name(name)
    }
}

impl Named for TieBreak {
    const WHAT: &'static str = "tie-break";
    fn name(self) -> &'static str {
        TieBreak::name(self)
    }
    fn from_name(name: &str) -> Option<Self> {
        TieBreak::from_name(name)
    }
}

impl Named for OnOverload {
    const WHAT: &'static str = "overload response";
    fn name(self) -> &'static str {
        OnOverload::name(self)
    }
    fn from_name(name: &str) -> Option<Self> {
        OnOverload::from_name(name)
    }
}

/// Serde for an optional [`Named`] value as its name.
pub mod by_name {
    use serde::{Deserialize as _, Deserializer, Serializer, de::Error as _};

    use super::Named;

    pub fn serialize<S: Serializer, T: Named>(value: &Option<T>, s: S) -> Result<S::Ok, S::Error> {
        match value {
            Some(v) => s.serialize_some(v.name()),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>, T: Named>(d: D) -> Result<Option<T>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|name| {
                T::from_name(&name)
                    .ok_or_else(|| D::Error::custom(format!("unknown {} '{name}'", T::WHAT)))
            })
            .transpose()
    }
}
