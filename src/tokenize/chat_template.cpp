// The Jinja subset of the Qwen chat templates: a lexer (text, {{ }}, {% %}, {# #} with `-`
// whitespace control, trim_blocks and lstrip_blocks as transformers sets them), a recursive-descent
// parser with Jinja's operator precedence, and an evaluator over values whose strings carry each
// byte's source. Errors inside are thrown as TemplateError and become a Status at the API.
#include "tokenize/chat_template.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <map>

namespace packmoe::tokenize {
namespace {

struct TemplateError {
  std::string message;
};

[[noreturn]] void fail(int line, const std::string& what) {
  throw TemplateError{"chat template line " + std::to_string(line) + ": " + what};
}

// A string and, per byte, the message it came from (-1: template text).
struct Str {
  std::string s;
  std::vector<int32_t> src;  // (s.size())
};

Str literal(std::string s) {
  Str out;
  out.src.assign(s.size(), -1);
  out.s = std::move(s);
  return out;
}

Str substr(const Str& x, size_t pos, size_t n) {
  Str out;
  out.s = x.s.substr(pos, n);
  out.src.assign(x.src.begin() + static_cast<std::ptrdiff_t>(pos),
                 x.src.begin() + static_cast<std::ptrdiff_t>(pos + out.s.size()));
  return out;
}

void append(Str& to, const Str& x) {
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

Value make_bool(bool b) {
  Value v;
  v.kind = Value::Kind::kBool;
  v.b = b;
  return v;
}
Value make_int(int64_t i) {
  Value v;
  v.kind = Value::Kind::kInt;
  v.i = i;
  return v;
}
Value make_str(Str s) {
  Value v;
  v.kind = Value::Kind::kString;
  v.s = std::move(s);
  return v;
}

const char* kind_name(Value::Kind k) {
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

bool truthy(const Value& v) {
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

bool equal(const Value& a, const Value& b) {
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

struct Tok {
  enum class Kind { kName, kInt, kStr, kOp, kEnd };
  Kind kind = Kind::kEnd;
  std::string text;
  int64_t i = 0;
};

std::vector<Tok> lex_expression(std::string_view s, int line) {
  std::vector<Tok> out;
  size_t p = 0;
  while (p < s.size()) {
    const char c = s[p];
    if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
      ++p;
    } else if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t e = p;
      while (e < s.size() && (std::isalnum(static_cast<unsigned char>(s[e])) || s[e] == '_')) ++e;
      out.push_back({Tok::Kind::kName, std::string(s.substr(p, e - p)), 0});
      p = e;
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t e = p;
      int64_t v = 0;
      while (e < s.size() && std::isdigit(static_cast<unsigned char>(s[e]))) {
        if (v > (INT64_MAX - 9) / 10) fail(line, "an integer literal out of range");
        v = v * 10 + (s[e++] - '0');
      }
      if (e < s.size() && s[e] == '.') fail(line, "float literals are not supported");
      out.push_back({Tok::Kind::kInt, std::string(s.substr(p, e - p)), v});
      p = e;
    } else if (c == '\'' || c == '"') {
      std::string v;
      size_t e = p + 1;
      for (; e < s.size() && s[e] != c; ++e) {
        if (s[e] != '\\' || e + 1 == s.size()) {
          v += s[e];
          continue;
        }
        const char x = s[++e];
        switch (x) {
          case 'n':
            v += '\n';
            break;
          case 't':
            v += '\t';
            break;
          case 'r':
            v += '\r';
            break;
          case '\\':
            v += '\\';
            break;
          case '\'':
            v += '\'';
            break;
          case '"':
            v += '"';
            break;
          default:
            v += '\\';
            v += x;  // Python keeps unknown escapes
        }
      }
      if (e >= s.size()) fail(line, "a string literal without its closing quote");
      out.push_back({Tok::Kind::kStr, v, 0});
      p = e + 1;
    } else {
      static const char* const kTwo[] = {"==", "!=", "<=", ">=", "//", "**"};
      std::string op(1, c);
      for (const char* t : kTwo)
        if (s.substr(p, 2) == t) op = t;
      if (op.size() == 1 && std::string_view("+-*/%~|.,:()[]{}<>=").find(c) == std::string::npos)
        fail(line, std::string("unexpected character '") + c + "'");
      out.push_back({Tok::Kind::kOp, op, 0});
      p += op.size();
    }
  }
  out.push_back({Tok::Kind::kEnd, "", 0});
  return out;
}

class ExprParser {
 public:
  ExprParser(std::vector<Tok> toks, int line) : toks_(std::move(toks)), line_(line) {}

  ExprP expression() {
    ExprP e = parse_or();
    if (is_name("if")) fail(line_, "inline 'if' expressions are not supported");
    return e;
  }
  const Tok& peek(size_t ahead = 0) const {
    return toks_[std::min(pos_ + ahead, toks_.size() - 1)];
  }
  bool at_end() const { return peek().kind == Tok::Kind::kEnd; }
  bool is_op(const char* op, size_t ahead = 0) const {
    return peek(ahead).kind == Tok::Kind::kOp && peek(ahead).text == op;
  }
  bool is_name(const char* n, size_t ahead = 0) const {
    return peek(ahead).kind == Tok::Kind::kName && peek(ahead).text == n;
  }
  Tok take() { return toks_[std::min(pos_++, toks_.size() - 1)]; }
  void expect_op(const char* op) {
    if (!is_op(op)) fail(line_, std::string("expected '") + op + "', found '" + peek().text + "'");
    ++pos_;
  }
  std::string expect_name() {
    if (peek().kind != Tok::Kind::kName)
      fail(line_, "expected a name, found '" + peek().text + "'");
    return take().text;
  }
  void expect_end() {
    if (!at_end()) fail(line_, "unexpected '" + peek().text + "'");
  }

 private:
  ExprP node(Expr::Op op, std::vector<ExprP> args, std::string name = {}) const {
    auto e = std::make_shared<Expr>();
    e->op = op;
    e->line = line_;
    e->args = std::move(args);
    e->name = std::move(name);
    return e;
  }
  ExprP parse_or() {
    ExprP e = parse_and();
    while (is_name("or")) {
      ++pos_;
      e = node(Expr::Op::kOr, {e, parse_and()});
    }
    return e;
  }
  ExprP parse_and() {
    ExprP e = parse_not();
    while (is_name("and")) {
      ++pos_;
      e = node(Expr::Op::kAnd, {e, parse_not()});
    }
    return e;
  }
  ExprP parse_not() {
    if (is_name("not")) {
      ++pos_;
      return node(Expr::Op::kNot, {parse_not()});
    }
    return parse_compare();
  }
  ExprP parse_compare() {
    ExprP e = parse_math1();
    for (;;) {
      static const char* const kOps[] = {"==", "!=", "<=", ">=", "<", ">"};
      std::string op;
      for (const char* o : kOps)
        if (is_op(o)) op = o;
      bool negated = false;
      if (op.empty() && is_name("in")) op = "in";
      if (op.empty() && is_name("not") && is_name("in", 1)) {
        op = "in";
        negated = true;
        ++pos_;
      }
      if (op.empty()) return e;
      ++pos_;
      auto b = std::make_shared<Expr>(*node(Expr::Op::kBinary, {e, parse_math1()}, op));
      b->negated = negated;
      e = b;
    }
  }
  ExprP parse_math1() {
    ExprP e = parse_concat();
    while (is_op("+") || is_op("-")) {
      const std::string op = take().text;
      e = node(Expr::Op::kBinary, {e, parse_concat()}, op);
    }
    return e;
  }
  ExprP parse_concat() {
    ExprP e = parse_math2();
    while (is_op("~")) {
      ++pos_;
      e = node(Expr::Op::kBinary, {e, parse_math2()}, "~");
    }
    return e;
  }
  ExprP parse_math2() {
    ExprP e = parse_unary();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%") || is_op("**")) {
      const std::string op = take().text;
      e = node(Expr::Op::kBinary, {e, parse_unary()}, op);
    }
    return e;
  }
  ExprP parse_unary() {
    if (is_op("-")) {
      ++pos_;
      return node(Expr::Op::kNeg, {parse_unary()});
    }
    ExprP e = parse_postfix(parse_primary());
    for (;;) {  // filters and tests bind tighter than every binary operator
      if (is_op("|")) {
        ++pos_;
        const std::string name = expect_name();
        std::vector<ExprP> args{e};
        if (is_op("(")) append_call_args(args);
        e = node(Expr::Op::kFilter, std::move(args), name);
      } else if (is_name("is")) {
        ++pos_;
        bool negated = false;
        if (is_name("not")) {
          negated = true;
          ++pos_;
        }
        // `none`, `true`, `false` are test names here.
        const std::string name = expect_name();
        auto t = std::make_shared<Expr>(*node(Expr::Op::kTest, {e}, name));
        t->negated = negated;
        e = t;
      } else {
        return e;
      }
    }
  }
  void append_call_args(std::vector<ExprP>& args) {
    expect_op("(");
    while (!is_op(")")) {
      if (peek().kind == Tok::Kind::kName && is_op("=", 1))
        fail(line_, "keyword arguments are not supported here ('" + peek().text + "=')");
      args.push_back(expression());
      if (!is_op(",")) break;
      ++pos_;
    }
    expect_op(")");
  }
  ExprP parse_primary() {
    const Tok t = take();
    if (t.kind == Tok::Kind::kInt) {
      auto e = std::make_shared<Expr>(*node(Expr::Op::kLiteral, {}));
      e->value = make_int(t.i);
      return e;
    }
    if (t.kind == Tok::Kind::kStr) {
      auto e = std::make_shared<Expr>(*node(Expr::Op::kLiteral, {}));
      e->value = make_str(literal(t.text));
      return e;
    }
    if (t.kind == Tok::Kind::kName) {
      auto e = std::make_shared<Expr>(*node(Expr::Op::kLiteral, {}));
      if (t.text == "true" || t.text == "True") return e->value = make_bool(true), e;
      if (t.text == "false" || t.text == "False") return e->value = make_bool(false), e;
      if (t.text == "none" || t.text == "None") return e->value.kind = Value::Kind::kNone, e;
      if (t.text == "namespace" && is_op("(")) return parse_namespace();
      return node(Expr::Op::kName, {}, t.text);
    }
    if (t.kind == Tok::Kind::kOp && t.text == "(") {
      ExprP e = expression();
      if (is_op(",")) fail(line_, "tuples are not supported");
      expect_op(")");
      return e;
    }
    if (t.kind == Tok::Kind::kOp && t.text == "[") {
      std::vector<ExprP> items;
      while (!is_op("]")) {
        items.push_back(expression());
        if (!is_op(",")) break;
        ++pos_;
      }
      expect_op("]");
      return node(Expr::Op::kList, std::move(items));
    }
    if (t.kind == Tok::Kind::kOp && t.text == "{") fail(line_, "dict literals are not supported");
    fail(line_, t.kind == Tok::Kind::kEnd ? std::string("an expression ends too early")
                                          : "unexpected '" + t.text + "'");
  }
  ExprP parse_namespace() {
    expect_op("(");
    auto e = std::make_shared<Expr>(*node(Expr::Op::kNamespace, {}));
    while (!is_op(")")) {
      e->keywords.push_back(expect_name());
      expect_op("=");
      e->args.push_back(expression());
      if (!is_op(",")) break;
      ++pos_;
    }
    expect_op(")");
    return e;
  }
  ExprP parse_postfix(ExprP e) {
    for (;;) {
      if (is_op(".")) {
        ++pos_;
        const std::string name = expect_name();
        if (is_op("(")) {
          std::vector<ExprP> args{e};
          append_call_args(args);
          e = node(Expr::Op::kMethod, std::move(args), name);
        } else {
          e = node(Expr::Op::kAttr, {e}, name);
        }
      } else if (is_op("[")) {
        ++pos_;
        ExprP parts[3];
        int n = 0;
        for (;;) {
          if (!is_op(":") && !is_op("]")) parts[n] = expression();
          if (!is_op(":") || n == 2) break;
          ++pos_;
          ++n;
        }
        expect_op("]");
        if (n == 0) {
          if (!parts[0]) fail(line_, "an empty subscript");
          e = node(Expr::Op::kIndex, {e, parts[0]});
        } else {
          e = node(Expr::Op::kSlice, {e, parts[0], parts[1], parts[2]});
        }
      } else if (is_op("(")) {
        fail(line_, "calling a value is not supported (only string methods and namespace())");
      } else {
        return e;
      }
    }
  }

  std::vector<Tok> toks_;
  size_t pos_ = 0;
  int line_;
};

}  // namespace

// ---- statements --------------------------------------------------------------------------------

struct ChatTemplate::Node {
  enum class Kind { kBlock, kText, kOutput, kIf, kFor, kSet };
  Kind kind = Kind::kBlock;
  int line = 0;
  std::string text;                              // kText
  ExprP expr;                                    // kOutput, kFor (the sequence), kSet (value)
  std::vector<std::pair<ExprP, Node>> branches;  // kIf: (condition, body); null: else
  std::string var, attr;                         // kFor / kSet target (attr: `ns.attr`)
  std::vector<Node> body;                        // kBlock, kFor
};

namespace {

using Node = ChatTemplate::Node;

struct Piece {
  enum class Kind { kText, kExpr, kStmt, kComment };
  Kind kind = Kind::kText;
  std::string body;
  int line = 1;
  bool trim_left = false, trim_right = false, keep_left = false;  // `{%-`, `-%}`, `{%+`
};

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

// Text and tags, with `-` whitespace control, trim_blocks and lstrip_blocks applied to the text.
std::vector<Piece> lex_template(std::string_view src) {
  std::vector<Piece> pieces;
  size_t pos = 0;
  int line = 1;
  auto count_lines = [&](size_t from, size_t to) {
    line += static_cast<int>(std::count(src.begin() + static_cast<std::ptrdiff_t>(from),
                                        src.begin() + static_cast<std::ptrdiff_t>(to), '\n'));
  };
  while (pos < src.size()) {
    size_t open = pos;
    for (;;) {
      open = src.find('{', open);
      if (open == std::string::npos || open + 1 >= src.size()) {
        open = std::string::npos;
        break;
      }
      const char n = src[open + 1];
      if (n == '{' || n == '%' || n == '#') break;
      ++open;
    }
    const size_t text_end = open == std::string::npos ? src.size() : open;
    if (text_end > pos)
      pieces.push_back({Piece::Kind::kText, std::string(src.substr(pos, text_end - pos)), line});
    count_lines(pos, text_end);
    if (open == std::string::npos) break;
    Piece tag;
    tag.line = line;
    const char kind = src[open + 1];
    tag.kind = kind == '{'   ? Piece::Kind::kExpr
               : kind == '%' ? Piece::Kind::kStmt
                             : Piece::Kind::kComment;
    const char close = kind == '{' ? '}' : kind;
    size_t p = open + 2;
    if (p < src.size() && src[p] == '-')
      tag.trim_left = true, ++p;
    else if (p < src.size() && src[p] == '+')
      tag.keep_left = true, ++p;
    size_t end = p;
    char quote = 0;
    for (; end + 1 < src.size(); ++end) {
      const char c = src[end];
      if (tag.kind != Piece::Kind::kComment) {
        if (quote) {
          if (c == '\\')
            ++end;
          else if (c == quote)
            quote = 0;
          continue;
        }
        if (c == '\'' || c == '"') {
          quote = c;
          continue;
        }
      }
      if (c == close && src[end + 1] == '}') break;
    }
    if (end + 1 >= src.size())
      fail(tag.line, "a tag without its closing '" + std::string(1, close) + "}'");
    size_t body_end = end;
    if (body_end > p && src[body_end - 1] == '-') tag.trim_right = true, --body_end;
    tag.body = std::string(src.substr(p, body_end - p));
    count_lines(open, end + 2);
    pos = end + 2;
    pieces.push_back(std::move(tag));
  }
  // Whitespace control on the text beside each tag.
  for (size_t k = 0; k < pieces.size(); ++k) {
    const Piece& t = pieces[k];
    if (t.kind == Piece::Kind::kText) continue;
    const bool block = t.kind != Piece::Kind::kExpr;
    if (k > 0 && pieces[k - 1].kind == Piece::Kind::kText) {
      std::string& before = pieces[k - 1].body;
      if (t.trim_left) {
        while (!before.empty() && is_space(before.back())) before.pop_back();
      } else if (block && !t.keep_left) {  // lstrip_blocks: spaces from the line's start
        size_t b = before.size();
        while (b > 0 && (before[b - 1] == ' ' || before[b - 1] == '\t')) --b;
        if (b > 0 ? before[b - 1] == '\n' : k == 1) before.resize(b);
      }
    }
    if (k + 1 < pieces.size() && pieces[k + 1].kind == Piece::Kind::kText) {
      std::string& after = pieces[k + 1].body;
      if (t.trim_right) {
        size_t b = 0;
        while (b < after.size() && is_space(after[b])) ++b;
        after.erase(0, b);
      } else if (block) {  // trim_blocks: the newline after a block tag
        if (after.rfind("\r\n", 0) == 0)
          after.erase(0, 2);
        else if (!after.empty() && after[0] == '\n')
          after.erase(0, 1);
      }
    }
  }
  return pieces;
}

class TemplateParser {
 public:
  explicit TemplateParser(std::vector<Piece> pieces) : pieces_(std::move(pieces)) {}

  Node parse_all() {
    std::string end;
    Node root = parse_block({}, &end);
    return root;
  }

 private:
  // Nodes up to a statement whose keyword is in `stops` (its keyword into *stop, its parser left
  // after the keyword in *rest); the end of the template when `stops` is empty.
  Node parse_block(const std::vector<std::string>& stops, std::string* stop,
                   std::unique_ptr<ExprParser>* rest = nullptr, int opened_at = 0) {
    Node block;
    while (k_ < pieces_.size()) {
      const Piece& p = pieces_[k_++];
      if (p.kind == Piece::Kind::kComment) continue;
      if (p.kind == Piece::Kind::kText) {
        if (p.body.empty()) continue;
        Node t;
        t.kind = Node::Kind::kText;
        t.line = p.line;
        t.text = p.body;
        block.body.push_back(std::move(t));
        continue;
      }
      auto ep = std::make_unique<ExprParser>(lex_expression(p.body, p.line), p.line);
      if (p.kind == Piece::Kind::kExpr) {
        Node o;
        o.kind = Node::Kind::kOutput;
        o.line = p.line;
        o.expr = ep->expression();
        ep->expect_end();
        block.body.push_back(std::move(o));
        continue;
      }
      if (ep->peek().kind != Tok::Kind::kName) fail(p.line, "a statement without a keyword");
      const std::string keyword = ep->take().text;
      if (std::find(stops.begin(), stops.end(), keyword) != stops.end()) {
        *stop = keyword;
        if (rest) *rest = std::move(ep);
        return block;
      }
      if (keyword == "if") {
        block.body.push_back(parse_if(*ep, p.line));
      } else if (keyword == "for") {
        block.body.push_back(parse_for(*ep, p.line));
      } else if (keyword == "set") {
        block.body.push_back(parse_set(*ep, p.line));
      } else {
        fail(p.line, "'{% " + keyword + "' is not supported by packmoe's chat template subset");
      }
    }
    if (!stops.empty())
      fail(opened_at, "the block opened here has no '{% " + stops.back() + " %}'");
    return block;
  }

  Node parse_if(ExprParser& ep, int line) {
    Node n;
    n.kind = Node::Kind::kIf;
    n.line = line;
    ExprP cond = ep.expression();
    ep.expect_end();
    for (;;) {
      std::string stop;
      std::unique_ptr<ExprParser> rest;
      Node body = parse_block({"elif", "else", "endif"}, &stop, &rest, line);
      n.branches.emplace_back(cond, std::move(body));
      if (stop == "endif") {
        rest->expect_end();
        return n;
      }
      if (!cond) fail(line, "'{% " + stop + "' after '{% else'");
      if (stop == "elif") {
        cond = rest->expression();
      } else {
        cond = nullptr;
      }
      rest->expect_end();
    }
  }

  Node parse_for(ExprParser& ep, int line) {
    Node n;
    n.kind = Node::Kind::kFor;
    n.line = line;
    n.var = ep.expect_name();
    if (ep.is_op(",")) fail(line, "'for' over several variables is not supported");
    if (!ep.is_name("in")) fail(line, "expected 'in' in '{% for'");
    ep.take();
    n.expr = ep.expression();
    if (ep.is_name("if") || ep.is_name("recursive"))
      fail(line, "'{% for ... " + ep.peek().text + "' is not supported");
    ep.expect_end();
    std::string stop;
    std::unique_ptr<ExprParser> rest;
    Node body = parse_block({"else", "endfor"}, &stop, &rest, line);
    if (stop == "else") fail(line, "'{% for' with '{% else' is not supported");
    rest->expect_end();
    n.body = std::move(body.body);
    return n;
  }

  Node parse_set(ExprParser& ep, int line) {
    Node n;
    n.kind = Node::Kind::kSet;
    n.line = line;
    n.var = ep.expect_name();
    if (ep.is_op(".")) {
      ep.take();
      n.attr = ep.expect_name();
    }
    if (ep.is_op(",")) fail(line, "'set' of several variables is not supported");
    if (!ep.is_op("=")) fail(line, "block '{% set' (without '=') is not supported");
    ep.take();
    n.expr = ep.expression();
    ep.expect_end();
    return n;
  }

  std::vector<Piece> pieces_;
  size_t k_ = 0;
};

// ---- evaluation --------------------------------------------------------------------------------

class Renderer {
 public:
  explicit Renderer(Dict globals) { scopes_.push_back(std::move(globals)); }

  void run(const Node& n, Str& out) {
    switch (n.kind) {
      case Node::Kind::kBlock:
        for (const Node& c : n.body) run(c, out);
        return;
      case Node::Kind::kText:
        append(out, literal(n.text));
        return;
      case Node::Kind::kOutput:
        append(out, to_text(eval(*n.expr), n.line));
        return;
      case Node::Kind::kIf:
        for (const auto& [cond, body] : n.branches)
          if (!cond || truthy(eval(*cond))) {
            run(body, out);
            return;
          }
        return;
      case Node::Kind::kFor: {
        const Value seq = eval(*n.expr);
        if (seq.kind != Value::Kind::kList)
          fail(n.line, std::string("'for' over a ") + kind_name(seq.kind) + " is not supported");
        const List items = *seq.list;
        const int64_t len = static_cast<int64_t>(items.size());
        for (int64_t i = 0; i < len; ++i) {
          Value loop;
          loop.kind = Value::Kind::kDict;
          loop.dict = std::make_shared<Dict>(Dict{{"index0", make_int(i)},
                                                  {"index", make_int(i + 1)},
                                                  {"revindex0", make_int(len - 1 - i)},
                                                  {"revindex", make_int(len - i)},
                                                  {"first", make_bool(i == 0)},
                                                  {"last", make_bool(i == len - 1)},
                                                  {"length", make_int(len)}});
          scopes_.push_back(Dict{{n.var, items[static_cast<size_t>(i)]}, {"loop", loop}});
          for (const Node& c : n.body) run(c, out);
          scopes_.pop_back();
        }
        return;
      }
      case Node::Kind::kSet: {
        Value v = eval(*n.expr);
        if (n.attr.empty()) {
          scopes_.back()[n.var] = std::move(v);
          return;
        }
        const Value ns = lookup(n.var);
        if (ns.kind != Value::Kind::kNamespace)
          fail(n.line, "'set " + n.var + "." + n.attr + "' needs a namespace(), '" + n.var +
                           "' is a " + kind_name(ns.kind));
        (*ns.dict)[n.attr] = std::move(v);
        return;
      }
    }
  }

 private:
  Value lookup(const std::string& name) const {
    for (auto s = scopes_.rbegin(); s != scopes_.rend(); ++s) {
      auto it = s->find(name);
      if (it != s->end()) return it->second;
    }
    return Value{};
  }

  static Str to_text(const Value& v, int line) {
    switch (v.kind) {
      case Value::Kind::kUndefined:
        return {};
      case Value::Kind::kNone:
        return literal("None");
      case Value::Kind::kBool:
        return literal(v.b ? "True" : "False");
      case Value::Kind::kInt:
        return literal(std::to_string(v.i));
      case Value::Kind::kString:
        return v.s;
      default:
        fail(line, std::string("printing a ") + kind_name(v.kind) + " is not supported");
    }
  }

  static int64_t need_int(const Value& v, int line, const char* what) {
    if (v.kind != Value::Kind::kInt)
      fail(line, std::string(what) + " needs an integer, not a " + kind_name(v.kind));
    return v.i;
  }
  static const Str& need_str(const Value& v, int line, const std::string& what) {
    if (v.kind != Value::Kind::kString)
      fail(line, what + " needs a string, not a " + kind_name(v.kind));
    return v.s;
  }

  Value eval(const Expr& e) {
    using Op = Expr::Op;
    switch (e.op) {
      case Op::kLiteral:
        return e.value;
      case Op::kName:
        return lookup(e.name);
      case Op::kList: {
        Value v;
        v.kind = Value::Kind::kList;
        v.list = std::make_shared<List>();
        for (const ExprP& a : e.args) v.list->push_back(eval(*a));
        return v;
      }
      case Op::kNamespace: {
        Value v;
        v.kind = Value::Kind::kNamespace;
        v.dict = std::make_shared<Dict>();
        for (size_t i = 0; i < e.args.size(); ++i) (*v.dict)[e.keywords[i]] = eval(*e.args[i]);
        return v;
      }
      case Op::kAttr:
        return member(eval(*e.args[0]), e.name, e.line);
      case Op::kIndex: {
        const Value base = eval(*e.args[0]);
        const Value key = eval(*e.args[1]);
        if (key.kind == Value::Kind::kString) return member(base, key.s.s, e.line);
        const int64_t i = need_int(key, e.line, "a subscript");
        if (base.kind == Value::Kind::kList) {
          const int64_t n = static_cast<int64_t>(base.list->size());
          const int64_t j = i < 0 ? i + n : i;
          return j >= 0 && j < n ? (*base.list)[static_cast<size_t>(j)] : Value{};
        }
        if (base.kind == Value::Kind::kString) {
          const int64_t n = static_cast<int64_t>(base.s.s.size());
          const int64_t j = i < 0 ? i + n : i;
          return j >= 0 && j < n ? make_str(substr(base.s, static_cast<size_t>(j), 1)) : Value{};
        }
        fail(e.line, std::string("subscript of a ") + kind_name(base.kind));
      }
      case Op::kSlice:
        return slice(e);
      case Op::kMethod:
        return method(e);
      case Op::kFilter:
        return filter(e);
      case Op::kTest: {
        const Value v = eval(*e.args[0]);
        return make_bool(test(v, e.name, e.line) != e.negated);
      }
      case Op::kNot:
        return make_bool(!truthy(eval(*e.args[0])));
      case Op::kNeg:
        return make_int(-need_int(eval(*e.args[0]), e.line, "'-'"));
      case Op::kAnd: {
        Value a = eval(*e.args[0]);
        return truthy(a) ? eval(*e.args[1]) : a;
      }
      case Op::kOr: {
        Value a = eval(*e.args[0]);
        return truthy(a) ? a : eval(*e.args[1]);
      }
      case Op::kBinary:
        return binary(e, eval(*e.args[0]), eval(*e.args[1]));
    }
    fail(e.line, "unknown expression");
  }

  static Value member(const Value& base, const std::string& name, int line) {
    if (base.kind == Value::Kind::kDict || base.kind == Value::Kind::kNamespace) {
      auto it = base.dict->find(name);
      return it == base.dict->end() ? Value{} : it->second;
    }
    if (base.kind == Value::Kind::kUndefined) fail(line, "'" + name + "' of an undefined value");
    return Value{};  // Jinja: a missing attribute is undefined
  }

  Value slice(const Expr& e) {
    const Value base = eval(*e.args[0]);
    int64_t n = 0;
    if (base.kind == Value::Kind::kList)
      n = static_cast<int64_t>(base.list->size());
    else if (base.kind == Value::Kind::kString)
      n = static_cast<int64_t>(base.s.s.size());
    else
      fail(e.line, std::string("slice of a ") + kind_name(base.kind));
    auto part = [&](int k) -> std::optional<int64_t> {
      if (!e.args[k]) return std::nullopt;
      return need_int(eval(*e.args[k]), e.line, "a slice bound");
    };
    const int64_t step = part(3).value_or(1);
    if (step == 0) fail(e.line, "a slice step of 0");
    // Python's slice.indices.
    auto clamp = [&](std::optional<int64_t> v, int64_t dflt) {
      if (!v) return dflt;
      int64_t x = *v < 0 ? *v + n : *v;
      return step > 0 ? std::clamp<int64_t>(x, 0, n) : std::clamp<int64_t>(x, -1, n - 1);
    };
    const int64_t start = clamp(part(1), step > 0 ? 0 : n - 1);
    const int64_t stop = clamp(part(2), step > 0 ? n : -1);
    Value out;
    if (base.kind == Value::Kind::kList) {
      out.kind = Value::Kind::kList;
      out.list = std::make_shared<List>();
    } else {
      out.kind = Value::Kind::kString;
    }
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
      if (base.kind == Value::Kind::kList)
        out.list->push_back((*base.list)[static_cast<size_t>(i)]);
      else
        append(out.s, substr(base.s, static_cast<size_t>(i), 1));
    }
    return out;
  }

  Value method(const Expr& e) {
    const Value base = eval(*e.args[0]);
    std::vector<Value> args;
    for (size_t i = 1; i < e.args.size(); ++i) args.push_back(eval(*e.args[i]));
    const std::string what = "'." + e.name + "()'";
    if (base.kind != Value::Kind::kString)
      fail(e.line, what + " on a " + kind_name(base.kind) + " is not supported");
    const Str& s = base.s;
    auto arg_str = [&](size_t i) { return need_str(args[i], e.line, what).s; };
    if (e.name == "strip" || e.name == "lstrip" || e.name == "rstrip") {
      if (args.size() > 1) fail(e.line, what + " takes at most one argument");
      const std::string chars = args.empty() ? std::string(" \t\n\r\f\v") : arg_str(0);
      size_t b = 0, en = s.s.size();
      if (e.name != "rstrip")
        while (b < en && chars.find(s.s[b]) != std::string::npos) ++b;
      if (e.name != "lstrip")
        while (en > b && chars.find(s.s[en - 1]) != std::string::npos) --en;
      return make_str(substr(s, b, en - b));
    }
    if (e.name == "startswith" || e.name == "endswith") {
      if (args.size() != 1) fail(e.line, what + " takes one argument");
      const std::string x = arg_str(0);
      const bool hit =
          x.size() <= s.s.size() &&
          (e.name == "startswith" ? s.s.compare(0, x.size(), x) == 0
                                  : s.s.compare(s.s.size() - x.size(), x.size(), x) == 0);
      return make_bool(hit);
    }
    if (e.name == "split") {
      if (args.size() != 1) fail(e.line, what + " is supported with one separator argument only");
      const std::string sep = arg_str(0);
      if (sep.empty()) fail(e.line, what + ": an empty separator");
      Value out;
      out.kind = Value::Kind::kList;
      out.list = std::make_shared<List>();
      size_t from = 0;
      for (;;) {
        const size_t at = s.s.find(sep, from);
        if (at == std::string::npos) break;
        out.list->push_back(make_str(substr(s, from, at - from)));
        from = at + sep.size();
      }
      out.list->push_back(make_str(substr(s, from, s.s.size() - from)));
      return out;
    }
    fail(e.line, "the string method " + what + " is not supported");
  }

  Value filter(const Expr& e) {
    const Value v = eval(*e.args[0]);
    if ((e.name == "length" || e.name == "count") && e.args.size() == 1) {
      if (v.kind == Value::Kind::kList) return make_int(static_cast<int64_t>(v.list->size()));
      if (v.kind == Value::Kind::kString) return make_int(static_cast<int64_t>(v.s.s.size()));
      if (v.kind == Value::Kind::kDict) return make_int(static_cast<int64_t>(v.dict->size()));
      fail(e.line, std::string("'|") + e.name + "' of a " + kind_name(v.kind));
    }
    if (e.name == "trim" && e.args.size() == 1) {
      const Str& s = need_str(v, e.line, "'|trim'");
      size_t b = 0, en = s.s.size();
      while (b < en && is_space(s.s[b])) ++b;
      while (en > b && is_space(s.s[en - 1])) --en;
      return make_str(substr(s, b, en - b));
    }
    fail(e.line, "the filter '|" + e.name + "' is not supported by packmoe's chat template subset");
  }

  static bool test(const Value& v, const std::string& name, int line) {
    using K = Value::Kind;
    if (name == "defined") return v.kind != K::kUndefined;
    if (name == "undefined") return v.kind == K::kUndefined;
    if (name == "none") return v.kind == K::kNone;
    if (name == "string") return v.kind == K::kString;
    if (name == "number" || name == "integer") return v.kind == K::kInt;
    if (name == "boolean") return v.kind == K::kBool;
    if (name == "true") return v.kind == K::kBool && v.b;
    if (name == "false") return v.kind == K::kBool && !v.b;
    if (name == "mapping") return v.kind == K::kDict;
    if (name == "sequence" || name == "iterable")
      return v.kind == K::kList || v.kind == K::kString || v.kind == K::kDict;
    fail(line, "the test 'is " + name + "' is not supported by packmoe's chat template subset");
  }

  static Value binary(const Expr& e, const Value& a, const Value& b) {
    using K = Value::Kind;
    const std::string& op = e.name;
    if (op == "==") return make_bool(equal(a, b));
    if (op == "!=") return make_bool(!equal(a, b));
    if (op == "~") {
      Str s = to_text(a, e.line);
      append(s, to_text(b, e.line));
      return make_str(std::move(s));
    }
    if (op == "in") {
      bool hit = false;
      if (b.kind == K::kString) {
        hit = b.s.s.find(need_str(a, e.line, "'in' a string").s) != std::string::npos;
      } else if (b.kind == K::kList) {
        hit = std::any_of(b.list->begin(), b.list->end(),
                          [&](const Value& x) { return equal(a, x); });
      } else if (b.kind == K::kDict) {
        hit = b.dict->count(need_str(a, e.line, "'in' a mapping").s) > 0;
      } else {
        fail(e.line, std::string("'in' a ") + kind_name(b.kind));
      }
      return make_bool(hit != e.negated);
    }
    if (op == "+" && a.kind == K::kString && b.kind == K::kString) {
      Str s = a.s;
      append(s, b.s);
      return make_str(std::move(s));
    }
    if (op == "+" && a.kind == K::kList && b.kind == K::kList) {
      Value v;
      v.kind = K::kList;
      v.list = std::make_shared<List>(*a.list);
      v.list->insert(v.list->end(), b.list->begin(), b.list->end());
      return v;
    }
    if (a.kind == K::kString && b.kind == K::kString &&
        (op == "<" || op == ">" || op == "<=" || op == ">=")) {
      const int c = a.s.s.compare(b.s.s);
      return make_bool(op == "<" ? c < 0 : op == ">" ? c > 0 : op == "<=" ? c <= 0 : c >= 0);
    }
    if (a.kind == K::kInt && b.kind == K::kInt) {
      int64_t r = 0;
      if (op == "+" && !__builtin_add_overflow(a.i, b.i, &r)) return make_int(r);
      if (op == "-" && !__builtin_sub_overflow(a.i, b.i, &r)) return make_int(r);
      if (op == "*" && !__builtin_mul_overflow(a.i, b.i, &r)) return make_int(r);
      if (op == "<") return make_bool(a.i < b.i);
      if (op == ">") return make_bool(a.i > b.i);
      if (op == "<=") return make_bool(a.i <= b.i);
      if (op == ">=") return make_bool(a.i >= b.i);
      if (op == "+" || op == "-" || op == "*") fail(e.line, "integer overflow in '" + op + "'");
    }
    fail(e.line, "'" + op + "' between a " + kind_name(a.kind) + " and a " + kind_name(b.kind) +
                     " is not supported");
  }

  std::vector<Dict> scopes_;  // globals, then one per enclosing loop iteration
};

}  // namespace

Result<ChatTemplate> ChatTemplate::parse(std::string_view source) {
  try {
    TemplateParser parser(lex_template(source));
    ChatTemplate t;
    t.root_ = std::make_shared<const Node>(parser.parse_all());
    return t;
  } catch (const TemplateError& e) {
    return Status::error(e.message);
  }
}

Result<RenderedChat> ChatTemplate::render(const std::vector<ChatMessage>& messages,
                                          bool add_generation_prompt,
                                          const ChatVariables& vars) const {
  Value list;
  list.kind = Value::Kind::kList;
  list.list = std::make_shared<List>();
  for (size_t i = 0; i < messages.size(); ++i) {
    Value m;
    m.kind = Value::Kind::kDict;
    Str content;
    content.s = messages[i].content;
    content.src.assign(content.s.size(), static_cast<int32_t>(i));
    m.dict = std::make_shared<Dict>(
        Dict{{"role", make_str(literal(messages[i].role))}, {"content", make_str(content)}});
    list.list->push_back(std::move(m));
  }
  Dict globals{{"messages", list}, {"add_generation_prompt", make_bool(add_generation_prompt)}};
  if (vars.bos_token) globals["bos_token"] = make_str(literal(*vars.bos_token));
  if (vars.eos_token) globals["eos_token"] = make_str(literal(*vars.eos_token));
  try {
    Renderer r(std::move(globals));
    Str out;
    r.run(*root_, out);
    return RenderedChat{std::move(out.s), std::move(out.src)};
  } catch (const TemplateError& e) {
    return Status::error(e.message);
  }
}

}  // namespace packmoe::tokenize
