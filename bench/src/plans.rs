//! The plans of the statements the schema's functions run: the queue's claim and its writes
//! over held jobs live in functions (`migrations/0029_job_statements.sql`) whose settings decide
//! their plans, and an `EXPLAIN` of a call shows only the call. [`prepare_function`] prepares
//! each statement of such a function as the function runs it, to be explained.

use sqlx::PgConnection;

/// Prepares each statement the schema's function `name` runs (each `RETURN QUERY`) as the
/// function runs it: on `conn`, with the function's settings set for the session, and as a
/// prepared statement whose parameters are the function's arguments, in order, then its
/// variables (each `name type;` of its `DECLARE`), in order. Returns the prepared
/// statements' names; [`unprepare`] undoes it.
pub async fn prepare_function(conn: &mut PgConnection, name: &str) -> Result<Vec<String>, sqlx::Error> {
    let (types, names, source, settings): (String, Vec<String>, String, Option<Vec<String>>) = sqlx::query_as(
        "SELECT (SELECT string_agg(format_type(t, NULL), ', ' ORDER BY o)
                 FROM unnest(p.proargtypes) WITH ORDINALITY AS a(t, o)),
                p.proargnames[1:p.pronargs], p.prosrc, p.proconfig
         FROM pg_proc p WHERE p.proname = $1",
    )
    .bind(name)
    .fetch_one(&mut *conn)
    .await?;
    for setting in settings.unwrap_or_default() {
        if let Some((key, value)) = setting.split_once('=') {
            sqlx::query("SELECT set_config($1, $2, false)").bind(key).bind(value).execute(&mut *conn).await?;
        }
    }
    let (mut names, mut types) = (names, vec![types]);
    for (variable, of) in variables(&source) {
        names.push(variable.to_string());
        types.push(of.to_string());
    }
    let types = types.join(", ");
    let mut prepared = Vec::new();
    for (i, body) in source.split("RETURN QUERY").skip(1).enumerate() {
        let mut sql = body[..body.find(';').unwrap_or(body.len())].to_string();
        for (n, arg) in names.iter().enumerate() {
            sql = replace_word(&sql, arg, &format!("${}", n + 1));
        }
        let statement = format!("{name}_{i}");
        sqlx::query(sqlx::AssertSqlSafe(format!("PREPARE {statement}({types}) AS {sql}"))).execute(&mut *conn).await?;
        prepared.push(statement);
    }
    Ok(prepared)
}

/// Undoes [`prepare_function`] on `conn`, which prepared `statements`.
pub async fn unprepare(conn: &mut PgConnection, statements: &[String]) -> Result<(), sqlx::Error> {
    for s in statements {
        sqlx::query(sqlx::AssertSqlSafe(format!("DEALLOCATE {s}"))).execute(&mut *conn).await?;
    }
    sqlx::query("RESET ALL").execute(&mut *conn).await.map(drop)
}

/// The variables a PL/pgSQL body declares (`name type;` between `DECLARE` and `BEGIN`, one
/// a line), with their types.
fn variables(source: &str) -> Vec<(&str, &str)> {
    let Some((_, declared)) = source.split_once("DECLARE") else { return Vec::new() };
    let declared = declared.split_once("BEGIN").map_or(declared, |(d, _)| d);
    declared
        .lines()
        .filter_map(|line| line.trim().strip_suffix(';')?.split_once(char::is_whitespace))
        .map(|(name, of)| (name, of.trim()))
        .collect()
}

/// `text` with every whole word `word` (not part of a longer name, nor a column of a named
/// table) replaced by `with`.
fn replace_word(text: &str, word: &str, with: &str) -> String {
    let is_name = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find(word) {
        let before = rest[..at].chars().next_back();
        let after = rest[at + word.len()..].chars().next();
        out.push_str(&rest[..at]);
        let whole = !before.is_some_and(|c| is_name(c) || c == '.') && !after.is_some_and(is_name);
        out.push_str(if whole { with } else { word });
        rest = &rest[at + word.len()..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::{replace_word, variables};

    #[test]
    fn declared_variables_are_read_with_their_types() {
        let body = "\n#variable_conflict use_column\nDECLARE\n    s0 smallint;\n    at timestamp with time zone;\nBEGIN\n    x := 1;\nEND ";
        assert_eq!(variables(body), vec![("s0", "smallint"), ("at", "timestamp with time zone")]);
        assert!(variables("BEGIN RETURN QUERY SELECT 1; END").is_empty());
    }

    #[test]
    fn only_whole_names_are_replaced() {
        assert_eq!(
            replace_word("lease_owner = owner, j.owner, owners, (owner)", "owner", "$1"),
            "lease_owner = $1, j.owner, owners, ($1)"
        );
    }
}
