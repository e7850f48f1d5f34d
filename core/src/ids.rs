//! Typed ids: what crosses a crate boundary says what it identifies.
//!
//! Row ids are UUIDs (v7, so they sort by creation) wrapped in one newtype per aggregate:
//! a [`DeliveryId`] cannot be passed where a [`JobId`] is expected. Each is transparent in
//! JSON and in Postgres (`uuid`), prints as the bare UUID, and parses from one.
//! [`AgentId`] and [`NodeId`] are names, restricted to an alphabet that is safe as a
//! directory name and as a configuration key.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

macro_rules! uuid_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, sqlx::Type)]
        #[serde(transparent)]
        #[sqlx(transparent)]
        pub struct $name(pub Uuid);

        impl $name {
            /// A new id (UUID v7: ordered by creation time).
            pub fn new() -> Self {
                Self(Uuid::now_v7())
            }
            /// The UUID inside.
            pub fn uuid(self) -> Uuid {
                self.0
            }
        }

        impl Default for $name {
            fn default() -> Self {
                Self::new()
            }
        }

        impl From<Uuid> for $name {
            fn from(u: Uuid) -> Self {
                Self(u)
            }
        }

        impl From<$name> for Uuid {
            fn from(id: $name) -> Self {
                id.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }

        impl FromStr for $name {
            type Err = uuid::Error;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Uuid::parse_str(s).map(Self)
            }
        }
    };
}

uuid_id!(
    /// A delivery: one email or webhook call on its way through the pipeline.
    DeliveryId
);
uuid_id!(
    /// A row of the job queue.
    JobId
);
uuid_id!(
    /// A durable run: an agent's unit of long work.
    RunId
);
uuid_id!(
    /// A sandboxed task.
    TaskId
);
uuid_id!(
    /// A standing, scoped approval.
    GrantId
);
uuid_id!(
    /// One agent's move from a node to another.
    RelocationId
);
uuid_id!(
    /// An agent turn: a model driven by airlock through the action protocol, inside a run.
    TurnId
);
uuid_id!(
    /// A non-repeatable tool call waiting for (or decided by) a human.
    AuthorizationId
);

/// The one name of an agent: in the capsule, in Postgres, on every node and in every
/// request. It becomes a directory name, so it is restricted to a safe alphabet.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct AgentId(String);

impl AgentId {
    /// 1 to 128 characters of `[A-Za-z0-9._-]`, starting with a letter or digit.
    pub fn parse(s: &str) -> Result<Self, InvalidName> {
        if valid_name(s, 128) {
            Ok(Self(s.to_string()))
        } else {
            Err(InvalidName { what: "agent id", value: s.into() })
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for AgentId {
    type Error = InvalidName;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        Self::parse(&s)
    }
}

impl From<AgentId> for String {
    fn from(a: AgentId) -> Self {
        a.0
    }
}

impl AsRef<str> for AgentId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for AgentId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The id of a node that can host agents (`worker.node_id`). Lowercase, because
/// configuration keys from the environment are lowercased (`nodes.<id>.url`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct NodeId(String);

impl NodeId {
    /// 1 to 64 characters of `[a-z0-9_-]`, starting with a letter or digit.
    pub fn parse(s: &str) -> Result<Self, InvalidName> {
        let ok = valid_name(s, 64) && !s.contains('.') && !s.bytes().any(|b| b.is_ascii_uppercase());
        if ok { Ok(Self(s.to_string())) } else { Err(InvalidName { what: "node id", value: s.into() }) }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for NodeId {
    type Error = InvalidName;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        Self::parse(&s)
    }
}

impl From<NodeId> for String {
    fn from(n: NodeId) -> Self {
        n.0
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn valid_name(s: &str, max: usize) -> bool {
    !s.is_empty()
        && s.len() <= max
        && s.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// A name outside its alphabet.
#[derive(Debug, Clone, thiserror::Error)]
#[error("`{value}` is not a valid {what}")]
pub struct InvalidName {
    pub what: &'static str,
    pub value: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(AgentId::parse("agent-1").is_ok());
        assert!(AgentId::parse("A.b_c-9").is_ok());
        for bad in ["", ".hidden", "-x", "a/b", "..", "a b", &"x".repeat(129)] {
            assert!(AgentId::parse(bad).is_err(), "{bad}");
        }
        assert!(NodeId::parse("node-a").is_ok());
        assert!(NodeId::parse("Node").is_err());
        assert!(NodeId::parse("a.b").is_err());
    }

    #[test]
    fn uuid_ids_are_transparent() {
        let id = DeliveryId::new();
        assert_eq!(serde_json::to_value(id).unwrap(), serde_json::json!(id.0.to_string()));
        assert_eq!(id.to_string().parse::<DeliveryId>().unwrap(), id);
        assert!("nope".parse::<JobId>().is_err());
    }
}
