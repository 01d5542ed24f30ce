//! The one place that touches the YAML parser: text → a tree of [`Node`]s, each with the line and
//! column it started at, so validation can point at every error, not only the first.
//!
//! Scalars are kept as text with their style; typing them (bool, integer, string) is the model's
//! job. Anchors and aliases are resolved here. Swapping the YAML crate is a change to this file.

use std::collections::HashMap;

use yaml_rust2::parser::{Event, MarkedEventReceiver, Parser};
use yaml_rust2::scanner::{Marker, TScalarStyle};

/// A position in the source, 1-based.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pos {
    /// Line, from 1.
    pub line: usize,
    /// Column, from 1.
    pub col: usize,
}

impl std::fmt::Display for Pos {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.line, self.col)
    }
}

/// One YAML value with its position.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// Where the value starts.
    pub pos: Pos,
    /// The value.
    pub value: Value,
}

/// The shape of a YAML value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// A scalar as written; `plain` is false for quoted and block scalars, which are always text.
    Scalar {
        /// The text.
        text: String,
        /// Whether the scalar was unquoted (and so may be a number, bool or null).
        plain: bool,
    },
    /// A sequence.
    Seq(Vec<Node>),
    /// A mapping, in source order (duplicates kept, for the model to report).
    Map(Vec<(Node, Node)>),
}

impl Node {
    /// Whether this is a plain `null`, `~` or empty scalar.
    #[must_use]
    pub fn is_null(&self) -> bool {
        matches!(&self.value, Value::Scalar { text, plain: true } if matches!(text.as_str(), "" | "~" | "null" | "Null" | "NULL"))
    }

    /// A short name of the node's kind, for error messages.
    #[must_use]
    pub fn kind(&self) -> &'static str {
        match &self.value {
            _ if self.is_null() => "null",
            Value::Scalar { .. } => "a scalar",
            Value::Seq(_) => "a list",
            Value::Map(_) => "a map",
        }
    }
}

/// A syntax error with its position.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyntaxError {
    /// Where the parser stopped.
    pub pos: Pos,
    /// What it found wrong.
    pub message: String,
}

/// Parses `text` into its documents.
///
/// # Errors
///
/// [`SyntaxError`] when the text is not well-formed YAML or uses an undefined alias.
pub fn parse(text: &str) -> Result<Vec<Node>, SyntaxError> {
    let mut builder = Builder::default();
    let mut parser = Parser::new_from_str(text);
    parser.load(&mut builder, true).map_err(|e| SyntaxError {
        pos: pos(*e.marker()),
        message: e.info().to_string(),
    })?;
    match builder.error {
        Some(e) => Err(e),
        None => Ok(builder.docs),
    }
}

fn pos(m: Marker) -> Pos {
    Pos {
        line: m.line(),
        col: m.col() + 1,
    }
}

/// Builds nodes from parser events with a stack of open collections.
#[derive(Default)]
struct Builder {
    docs: Vec<Node>,
    /// Open collections: the node being filled and, for maps, a key waiting for its value.
    stack: Vec<(Node, Option<Node>, usize)>,
    anchors: HashMap<usize, Node>,
    error: Option<SyntaxError>,
}

impl Builder {
    fn push_value(&mut self, node: Node) {
        let Some((parent, pending_key, _)) = self.stack.last_mut() else {
            self.docs.push(node);
            return;
        };
        match &mut parent.value {
            Value::Seq(items) => items.push(node),
            Value::Map(entries) => match pending_key.take() {
                Some(key) => entries.push((key, node)),
                None => *pending_key = Some(node),
            },
            Value::Scalar { .. } => {}
        }
    }

    fn finish_collection(&mut self) {
        if let Some((mut node, _, anchor)) = self.stack.pop() {
            // A block map's start event is marked at its first `:`; point at its first key.
            if let Value::Map(entries) = &node.value
                && let Some((first, _)) = entries.first()
                && (first.pos.line, first.pos.col) < (node.pos.line, node.pos.col)
            {
                node.pos = first.pos;
            }
            if anchor > 0 {
                self.anchors.insert(anchor, node.clone());
            }
            self.push_value(node);
        }
    }
}

impl MarkedEventReceiver for Builder {
    fn on_event(&mut self, ev: Event, mark: Marker) {
        let pos = pos(mark);
        match ev {
            Event::Scalar(text, style, anchor, _tag) => {
                let node = Node {
                    pos,
                    value: Value::Scalar {
                        text,
                        plain: style == TScalarStyle::Plain,
                    },
                };
                if anchor > 0 {
                    self.anchors.insert(anchor, node.clone());
                }
                self.push_value(node);
            }
            Event::SequenceStart(anchor, _) => self.stack.push((
                Node {
                    pos,
                    value: Value::Seq(Vec::new()),
                },
                None,
                anchor,
            )),
            Event::MappingStart(anchor, _) => self.stack.push((
                Node {
                    pos,
                    value: Value::Map(Vec::new()),
                },
                None,
                anchor,
            )),
            Event::SequenceEnd | Event::MappingEnd => self.finish_collection(),
            Event::Alias(id) => match self.anchors.get(&id) {
                Some(node) => {
                    let node = Node {
                        pos,
                        value: node.value.clone(),
                    };
                    self.push_value(node);
                }
                None => {
                    self.error.get_or_insert(SyntaxError {
                        pos,
                        message: "alias to an unknown anchor".to_string(),
                    });
                }
            },
            Event::Nothing
            | Event::StreamStart
            | Event::StreamEnd
            | Event::DocumentStart
            | Event::DocumentEnd => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_and_shapes() {
        let docs = parse("domain: edge\ndescriptors:\n  - key: a\n    value: 'x'\n").unwrap();
        assert_eq!(docs.len(), 1);
        let Value::Map(entries) = &docs[0].value else {
            panic!("not a map")
        };
        assert_eq!(entries[0].0.pos, Pos { line: 1, col: 1 });
        assert_eq!(entries[1].0.pos, Pos { line: 2, col: 1 });
        let Value::Seq(items) = &entries[1].1.value else {
            panic!("not a list")
        };
        let Value::Map(d) = &items[0].value else {
            panic!("not a map")
        };
        assert_eq!(d[0].0.pos, Pos { line: 3, col: 5 });
        assert_eq!(
            d[1].1.value,
            Value::Scalar {
                text: "x".into(),
                plain: false
            }
        );
    }

    #[test]
    fn aliases_resolve() {
        let docs = parse("a: &x {k: 1}\nb: *x\n").unwrap();
        let Value::Map(entries) = &docs[0].value else {
            panic!("not a map")
        };
        assert_eq!(entries[0].1.value, entries[1].1.value);
    }

    #[test]
    fn syntax_errors_have_a_position() {
        let err = parse("a: [1, 2\nb: 3\n").unwrap_err();
        assert!(err.pos.line >= 1, "{err:?}");
        assert!(!err.message.is_empty());
    }
}
