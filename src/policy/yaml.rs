//! The one place that touches the YAML parser: text → a tree of [`Node`]s, each with the line and
//! column it started at, so validation can point at every error. Scalars stay text with their
//! style (the model types them); anchors and aliases are resolved here. Swapping the YAML crate
//! is a change to this file.
//!
//! Aliases are bounded, because each is a copy (nine anchors of nine aliases fit in a kilobyte and
//! expand to 9⁹ nodes): a file passing [`MAX_ALIAS_NODES`], [`MAX_ALIAS_BYTES`] or [`MAX_DEPTH`] is
//! refused at the alias that crosses the line, before anything is copied.

use std::collections::HashMap;
use std::rc::Rc;

use yaml_rust2::parser::{Event, Parser};
use yaml_rust2::scanner::{Marker, TScalarStyle};

/// The most nodes the aliases of one file may add to it, counting every node of every copy. Far
/// more than a real file needs (a reused `rate_limit` block is 5 to 9 nodes, so this is over
/// 100,000 aliases), and a bounded cost (some 100 MB at worst).
pub const MAX_ALIAS_NODES: usize = 1_000_000;

/// The most bytes of scalar text the aliases of one file may add to it (as much as a file
/// may hold).
pub const MAX_ALIAS_BYTES: usize = 16 << 20;

/// The deepest nesting of lists and maps in a file, aliases expanded: keeps the recursive
/// readers of the tree (the model, `Drop`) far from the end of a thread's stack, where real
/// descriptor trees are a few levels deep and each level is two collections.
pub const MAX_DEPTH: usize = 128;

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

/// A syntax error, or a file past a bound, with its position.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyntaxError {
    /// Where the parser stopped.
    pub pos: Pos,
    /// What it found wrong, as said to the user (`invalid YAML: ...` for a syntax error).
    pub message: String,
}

/// Parses `text` into its documents.
///
/// # Errors
///
/// [`SyntaxError`] when the text is not well-formed YAML, uses an undefined alias, or passes
/// [`MAX_ALIAS_NODES`] or [`MAX_DEPTH`].
pub fn parse(text: &str) -> Result<Vec<Node>, SyntaxError> {
    parse_within(text, MAX_ALIAS_NODES, MAX_ALIAS_BYTES)
}

/// As [`parse`], with at most `max_alias_nodes` nodes and `max_alias_bytes` bytes of text added
/// by aliases.
fn parse_within(
    text: &str,
    max_alias_nodes: usize,
    max_alias_bytes: usize,
) -> Result<Vec<Node>, SyntaxError> {
    let mut builder = Builder {
        max_alias_nodes,
        max_alias_bytes,
        ..Builder::default()
    };
    // Driven event by event (the parser's own `load` recurses once per nesting level, so a deep
    // file would overflow the stack before the depth bound is checked).
    let mut parser = Parser::new_from_str(text);
    loop {
        let (event, mark) = parser.next_token().map_err(|e| SyntaxError {
            pos: pos(*e.marker()),
            message: format!("invalid YAML: {}", e.info()),
        })?;
        if event == Event::StreamEnd {
            break;
        }
        builder.on_event(event, mark)?;
    }
    // Without the anchors' references, a value used once is moved into the tree, not copied.
    let docs = std::mem::take(&mut builder.docs);
    drop(builder);
    Ok(docs.into_iter().map(Shared::into_node).collect())
}

fn pos(m: Marker) -> Pos {
    Pos {
        line: m.line(),
        col: m.col() + 1,
    }
}

/// A value while building: anchored values are shared by every alias, never copied, until the
/// whole file is known to be within bounds.
#[derive(Clone)]
struct Shared {
    pos: Pos,
    value: Rc<Tree>,
    /// Nodes once expanded, this one included.
    size: usize,
    /// Bytes of scalar text once expanded.
    bytes: usize,
    /// Nesting levels once expanded: 0 for a scalar, 1 + the deepest child for a collection.
    height: usize,
}

enum Tree {
    Scalar { text: String, plain: bool },
    Seq(Vec<Shared>),
    Map(Vec<(Shared, Shared)>),
}

impl Shared {
    /// The expanded, owned tree: moved where this is the only reference, copied where an alias
    /// shares it. Recursion is bounded by [`MAX_DEPTH`].
    fn into_node(self) -> Node {
        let value = match Rc::try_unwrap(self.value) {
            Ok(Tree::Scalar { text, plain }) => Value::Scalar { text, plain },
            Ok(Tree::Seq(items)) => Value::Seq(items.into_iter().map(Self::into_node).collect()),
            Ok(Tree::Map(entries)) => Value::Map(
                entries
                    .into_iter()
                    .map(|(k, v)| (k.into_node(), v.into_node()))
                    .collect(),
            ),
            Err(shared) => match &*shared {
                Tree::Scalar { text, plain } => Value::Scalar {
                    text: text.clone(),
                    plain: *plain,
                },
                Tree::Seq(items) => {
                    Value::Seq(items.iter().map(|i| i.clone().into_node()).collect())
                }
                Tree::Map(entries) => Value::Map(
                    entries
                        .iter()
                        .map(|(k, v)| (k.clone().into_node(), v.clone().into_node()))
                        .collect(),
                ),
            },
        };
        Node {
            pos: self.pos,
            value,
        }
    }
}

/// A list or map being filled.
struct Open {
    pos: Pos,
    /// Items of a list, or keys and values of a map in turn.
    items: Vec<Shared>,
    map: bool,
    anchor: usize,
    size: usize,
    bytes: usize,
    height: usize,
}

/// Builds nodes from parser events with a stack of open collections.
#[derive(Default)]
struct Builder {
    docs: Vec<Shared>,
    stack: Vec<Open>,
    anchors: HashMap<usize, Shared>,
    max_alias_nodes: usize,
    max_alias_bytes: usize,
    /// Nodes added by aliases so far.
    alias_nodes: usize,
    /// Bytes of text added by aliases so far.
    alias_bytes: usize,
}

impl Builder {
    fn push_value(&mut self, node: Shared) {
        match self.stack.last_mut() {
            Some(parent) => {
                parent.size += node.size;
                parent.bytes += node.bytes;
                parent.height = parent.height.max(node.height + 1);
                parent.items.push(node);
            }
            None => self.docs.push(node),
        }
    }

    fn open(&mut self, pos: Pos, anchor: usize, map: bool) -> Result<(), SyntaxError> {
        if self.stack.len() >= MAX_DEPTH {
            return Err(too_deep(pos));
        }
        self.stack.push(Open {
            pos,
            items: Vec::new(),
            map,
            anchor,
            size: 1,
            bytes: 0,
            height: 1,
        });
        Ok(())
    }

    fn close(&mut self) {
        let Some(open) = self.stack.pop() else {
            return;
        };
        let mut pos = open.pos;
        let value = if open.map {
            // A block map's start event is marked at its first `:`; point at its first key.
            if let Some(first) = open.items.first()
                && (first.pos.line, first.pos.col) < (pos.line, pos.col)
            {
                pos = first.pos;
            }
            let mut entries = Vec::with_capacity(open.items.len() / 2);
            let mut items = open.items.into_iter();
            while let (Some(k), Some(v)) = (items.next(), items.next()) {
                entries.push((k, v));
            }
            Tree::Map(entries)
        } else {
            Tree::Seq(open.items)
        };
        let node = Shared {
            pos,
            value: Rc::new(value),
            size: open.size,
            bytes: open.bytes,
            height: open.height,
        };
        if open.anchor > 0 {
            self.anchors.insert(open.anchor, node.clone());
        }
        self.push_value(node);
    }

    /// An alias: checked against both bounds before it is added (as a shared reference).
    fn alias(&mut self, id: usize, pos: Pos) -> Result<(), SyntaxError> {
        let Some(target) = self.anchors.get(&id) else {
            return Err(SyntaxError {
                pos,
                message: "invalid YAML: alias to an unknown anchor".to_string(),
            });
        };
        if self.stack.len() + target.height > MAX_DEPTH {
            return Err(too_deep(pos));
        }
        let nodes = self.alias_nodes.saturating_add(target.size);
        if nodes > self.max_alias_nodes {
            return Err(SyntaxError {
                pos,
                message: format!(
                    "YAML aliases expand to more than {} nodes",
                    self.max_alias_nodes
                ),
            });
        }
        let bytes = self.alias_bytes.saturating_add(target.bytes);
        if bytes > self.max_alias_bytes {
            return Err(SyntaxError {
                pos,
                message: format!(
                    "YAML aliases expand to more than {} bytes of text",
                    self.max_alias_bytes
                ),
            });
        }
        self.alias_nodes = nodes;
        self.alias_bytes = bytes;
        let node = Shared {
            pos,
            ..target.clone()
        };
        self.push_value(node);
        Ok(())
    }

    fn on_event(&mut self, ev: Event, mark: Marker) -> Result<(), SyntaxError> {
        let pos = pos(mark);
        match ev {
            Event::Scalar(text, style, anchor, _tag) => {
                let node = Shared {
                    pos,
                    bytes: text.len(),
                    value: Rc::new(Tree::Scalar {
                        text,
                        plain: style == TScalarStyle::Plain,
                    }),
                    size: 1,
                    height: 0,
                };
                if anchor > 0 {
                    self.anchors.insert(anchor, node.clone());
                }
                self.push_value(node);
            }
            Event::SequenceStart(anchor, _) => self.open(pos, anchor, false)?,
            Event::MappingStart(anchor, _) => self.open(pos, anchor, true)?,
            Event::SequenceEnd | Event::MappingEnd => self.close(),
            Event::Alias(id) => self.alias(id, pos)?,
            Event::Nothing
            | Event::StreamStart
            | Event::StreamEnd
            | Event::DocumentStart
            | Event::DocumentEnd => {}
        }
        Ok(())
    }
}

fn too_deep(pos: Pos) -> SyntaxError {
    SyntaxError {
        pos,
        message: format!("YAML nests more than {MAX_DEPTH} levels deep"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{problems, rpu, set};

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

    /// `levels` anchors of `fan_out` items each, every level aliasing the one before, inside a
    /// policy's `metadata`: `fan_out^levels` nodes from a few hundred bytes.
    fn alias_bomb(levels: usize, fan_out: usize) -> String {
        let mut text = String::from("domain: bomb\ndescriptors: []\nmetadata:\n");
        let names: Vec<char> = ('a'..='z').take(levels).collect();
        for (i, name) in names.iter().enumerate() {
            let item = if i == 0 {
                "x".to_string()
            } else {
                format!("*{}", names[i - 1])
            };
            let items = vec![item; fan_out].join(", ");
            text.push_str(&format!("  {name}: &{name} [{items}]\n"));
        }
        text
    }

    #[test]
    fn an_alias_bomb_is_refused_at_the_alias_that_passes_the_bound() {
        let text = alias_bomb(9, 9);
        let err = parse(&text).unwrap_err();
        assert_eq!(
            err.message,
            format!("YAML aliases expand to more than {MAX_ALIAS_NODES} nodes")
        );
        // Aliases of levels b..f add 90 + 819 + 7,380 + 66,429 + 597,870 = 672,588 nodes; the
        // first alias of g (597,871 more) passes a million, and nothing of it is copied.
        let line = text.lines().position(|l| l.starts_with("  g:")).unwrap() + 1;
        let col = text.lines().nth(line - 1).unwrap().find('*').unwrap() + 1;
        assert_eq!(err.pos, Pos { line, col }, "{text}");
    }

    #[test]
    fn aliases_up_to_the_bound_expand() {
        // a: 4 nodes; b: 3 aliases of a (12) + its list = 13; c: 3 aliases of b (39).
        let text = alias_bomb(3, 3);
        let docs = parse_within(&text, 12 + 39, MAX_ALIAS_BYTES).unwrap();
        fn count(n: &Node) -> usize {
            1 + match &n.value {
                Value::Scalar { .. } => 0,
                Value::Seq(items) => items.iter().map(count).sum(),
                Value::Map(entries) => entries.iter().map(|(k, v)| count(k) + count(v)).sum(),
            }
        }
        let Value::Map(top) = &docs[0].value else {
            panic!("not a map")
        };
        let c = &top[2].1;
        let Value::Map(levels) = &c.value else {
            panic!("not a map")
        };
        assert_eq!(count(&levels[2].1), 1 + 3 * 13);
        let err = parse_within(&text, 12 + 39 - 1, MAX_ALIAS_BYTES).unwrap_err();
        assert!(err.message.contains("more than 50 nodes"), "{err:?}");
        // The last alias of c crosses it.
        let last = text.lines().nth(5).unwrap().rfind('*').unwrap() + 1;
        assert_eq!(err.pos, Pos { line: 6, col: last });
    }

    #[test]
    fn aliases_of_long_text_are_bounded_by_bytes() {
        // Four aliases of a 10-byte scalar: 40 bytes of text.
        let text = "a: &a 0123456789\nb: [*a, *a, *a, *a]\n";
        parse_within(text, MAX_ALIAS_NODES, 40).unwrap();
        let err = parse_within(text, MAX_ALIAS_NODES, 39).unwrap_err();
        assert_eq!(
            err.message,
            "YAML aliases expand to more than 39 bytes of text"
        );
        assert_eq!(err.pos, Pos { line: 2, col: 17 });
        // A megabyte, aliased seventeen times inside a list: refused at the seventeenth.
        let big = format!(
            "a: &a {}\nb: [{}]\n",
            "x".repeat(1 << 20),
            vec!["*a"; 17].join(", ")
        );
        let err = parse(&big).unwrap_err();
        assert!(err.message.contains("bytes of text"), "{err:?}");
        assert_eq!(
            err.pos,
            Pos {
                line: 2,
                col: 5 + 16 * 4
            }
        );
    }

    #[test]
    fn nesting_is_bounded_with_aliases_expanded() {
        let ok = format!("{}x{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
        parse(&ok).unwrap();
        let deep = format!("k:\n  {}x\n", "- ".repeat(MAX_DEPTH + 10));
        let err = parse(&deep).unwrap_err();
        assert_eq!(
            err.message,
            format!("YAML nests more than {MAX_DEPTH} levels deep")
        );
        // An alias deep enough to pass it with what it expands to.
        let half = MAX_DEPTH / 2 + 1;
        let aliased = format!(
            "a: &a {}x{}\nb: {}*a{}\n",
            "[".repeat(half),
            "]".repeat(half),
            "[".repeat(half),
            "]".repeat(half)
        );
        let err = parse(&aliased).unwrap_err();
        assert_eq!(err.pos.line, 2, "{err:?}");
        assert!(err.message.contains("levels deep"), "{err:?}");
    }

    #[test]
    fn syntax_errors_have_a_position() {
        let err = parse("a: [1, 2\nb: 3\n").unwrap_err();
        assert!(err.pos.line >= 1, "{err:?}");
        assert!(!err.message.is_empty());
    }

    #[test]
    fn aliases_reuse_rate_limit_blocks() {
        let s = set(
            "domain: test-domain\ndescriptors:\n  - key: key1\n    rate_limit: &std {unit: minute, requests_per_unit: 7}\n  - key: key2\n    rate_limit: *std\n",
        );
        assert_eq!(rpu(&s, &[("key1", "v")]), Some(7));
        assert_eq!(rpu(&s, &[("key2", "v")]), Some(7));
    }

    #[test]
    fn an_alias_bomb_is_a_positioned_problem() {
        let text = alias_bomb(9, 9);
        let p = problems(&text);
        assert_eq!(p.len(), 1, "{p:?}");
        assert_eq!(
            p[0].to_string(),
            format!(
                "bad.yaml:{}: YAML aliases expand to more than 1000000 nodes",
                p[0].pos.unwrap()
            )
        );
    }
}
