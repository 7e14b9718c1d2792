// The chat template's parser: a lexer of the template (text, {{ }}, {% %}, {# #} with `-`
// whitespace control, trim_blocks and lstrip_blocks as transformers sets them) and of its
// expressions, and a recursive-descent parser with Jinja's operator precedence. Invariant: a
// statement, operator or literal outside the subset is an error naming it here; filters, tests
// and methods by name are checked when rendered (chat_template.cpp).
#include <algorithm>
#include <cctype>
#include <cstdint>

#include "tokenize/chat_template_ast.h"

namespace packmoe::tokenize {
namespace {

using namespace jinja;
using Node = ChatTemplate::Node;

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

struct Piece {
  enum class Kind { kText, kExpr, kStmt, kComment };
  Kind kind = Kind::kText;
  std::string body;
  int line = 1;
  bool trim_left = false, trim_right = false, keep_left = false;  // `{%-`, `-%}`, `{%+`
};

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

}  // namespace packmoe::tokenize
