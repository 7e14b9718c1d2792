// The parsed form of a chat template (tokenize/chat_template.h) shared by its parser
// (chat_template_parse.cpp) and its renderer (chat_template.cpp): values whose strings carry each
// byte's source message, expressions and statements. Internal to src/tokenize. Invariant: a
// Node tree holds only the constructs of the supported subset; errors are TemplateError, thrown
// with the template line and turned into a Status at the API.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tokenize/chat_template.h"

namespace packmoe::tokenize {
namespace jinja {

struct TemplateError {
  std::string message;
};

[[noreturn]] inline void fail(int line, const std::string& what) {
  throw TemplateError{"chat template line " + std::to_string(line) + ": " + what};
}

// A string and, per byte, the message it came from (-1: template text).
struct Str {
  std::string s;
  std::vector<int32_t> src;  // (s.size())
};

inline Str literal(std::string s) {
  Str out;
  out.src.assign(s.size(), -1);
  out.s = std::move(s);
  return out;
}

inline Str substr(const Str& x, size_t pos, size_t n) {
  Str out;
  out.s = x.s.substr(pos, n);
  out.src.assign(x.src.begin() + static_cast<std::ptrdiff_t>(pos),
                 x.src.begin() + static_cast<std::ptrdiff_t>(pos + out.s.size()));
  return out;
}

inline void append(Str& to, const Str& x) {
  to.s += x.s;
  to.src.insert(to.src.end(), x.src.begin(), x.src.end());
}

struct Value;
using List = std::vector<Value>;
using Dict = std::map<std::string, Value>;

struct Value {
  enum class Kind { kUndefined, kNone, kBool, kInt, kString, kList, kDict, kNamespace };
  Kind kind = Kind::kUndefined;
  bool b = false;
  int64_t i = 0;
  Str s;
  std::shared_ptr<List> list;
  std::shared_ptr<Dict> dict;  // kDict, kNamespace (shared: `set ns.x` changes it in place)
};

inline Value make_bool(bool b) {
  Value v;
  v.kind = Value::Kind::kBool;
  v.b = b;
  return v;
}
inline Value make_int(int64_t i) {
  Value v;
  v.kind = Value::Kind::kInt;
  v.i = i;
  return v;
}
inline Value make_str(Str s) {
  Value v;
  v.kind = Value::Kind::kString;
  v.s = std::move(s);
  return v;
}

inline const char* kind_name(Value::Kind k) {
  switch (k) {
    case Value::Kind::kUndefined:
      return "undefined";
    case Value::Kind::kNone:
      return "none";
    case Value::Kind::kBool:
      return "boolean";
    case Value::Kind::kInt:
      return "integer";
    case Value::Kind::kString:
      return "string";
    case Value::Kind::kList:
      return "list";
    case Value::Kind::kDict:
      return "mapping";
    case Value::Kind::kNamespace:
      return "namespace";
  }
  return "?";
}

inline bool truthy(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return false;
    case Value::Kind::kBool:
      return v.b;
    case Value::Kind::kInt:
      return v.i != 0;
    case Value::Kind::kString:
      return !v.s.s.empty();
    case Value::Kind::kList:
      return !v.list->empty();
    case Value::Kind::kDict:
      return !v.dict->empty();
    case Value::Kind::kNamespace:
      return true;
  }
  return false;
}

inline bool equal(const Value& a, const Value& b) {
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return true;
    case Value::Kind::kBool:
      return a.b == b.b;
    case Value::Kind::kInt:
      return a.i == b.i;
    case Value::Kind::kString:
      return a.s.s == b.s.s;
    case Value::Kind::kList:
      return a.list->size() == b.list->size() &&
             std::equal(a.list->begin(), a.list->end(), b.list->begin(), equal);
    default:
      return a.dict == b.dict;
  }
}

inline bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

// ---- expressions -------------------------------------------------------------------------------

struct Expr;
using ExprP = std::shared_ptr<const Expr>;

struct Expr {
  enum class Op {
    kLiteral,
    kName,
    kAttr,
    kIndex,
    kSlice,
    kMethod,
    kFilter,
    kTest,
    kNot,
    kNeg,
    kBinary,
    kAnd,
    kOr,
    kNamespace,
    kList
  };
  Op op = Op::kLiteral;
  int line = 0;
  Value value;              // kLiteral
  std::string name;         // kName, kAttr, kMethod, kFilter, kTest, kBinary (the operator)
  bool negated = false;     // kTest: `is not`; kBinary "in": `not in`
  std::vector<ExprP> args;  // operands; kSlice: base, start, stop, step (null: absent)
  std::vector<std::string> keywords;  // kNamespace: the name of each argument
};

}  // namespace jinja

// ---- statements --------------------------------------------------------------------------------

struct ChatTemplate::Node {
  enum class Kind { kBlock, kText, kOutput, kIf, kFor, kSet };
  Kind kind = Kind::kBlock;
  int line = 0;
  std::string text;   // kText
  jinja::ExprP expr;  // kOutput, kFor (the sequence), kSet (value)
  std::vector<std::pair<jinja::ExprP, Node>> branches;  // kIf: (condition, body); null: else
  std::string var, attr;                                // kFor / kSet target (attr: `ns.attr`)
  std::vector<Node> body;                               // kBlock, kFor
};

}  // namespace packmoe::tokenize
