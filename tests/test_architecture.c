/*
 * test_architecture.c — the include arrows docs/architecture.md describes.
 *
 * The layers include only the layers below them; the exceptions are the table "Include arrows that go up today".
 * Checked here, from the #include lines of the sources: every arrow the table lists is still there (a row whose
 * arrow has gone must go too, so the table stays current), and the arrows removed so far (struct data_spec in
 * lib/data.h; numerics plugged into the run through lib/train.h's train_probe) do not come back.
 */
#include <criterion/criterion.h>

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The whole of a file under the source tree, NUL-terminated (the test fails if it cannot be read). */
static char *read_source(const char *rel)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", AMP_SOURCE_DIR, rel);
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "cannot read %s", path);
    static char buf[1 << 20];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    char *copy = malloc(n + 1);
    cr_assert_not_null(copy);
    memcpy(copy, buf, n + 1);
    return copy;
}

/* Whether source file `rel` has a line `#include "header"` (header: a file name, e.g. "model.h"). */
static bool includes(const char *rel, const char *header)
{
    char *text = read_source(rel);
    bool found = false;
    for (char *line = text; line && !found; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL) {
        line += strspn(line, " \t");
        if (strncmp(line, "#include \"", 10) != 0)
            continue;
        const char *name = line + 10;
        size_t len = strcspn(name, "\"");
        found = len == strlen(header) && !strncmp(name, header, len);
    }
    free(text);
    return found;
}

Test(arrows, removed_arrows_stay_removed)
{
    static const char *const gone[][2] = {
        {"lib/data.h", "model.h"},     /* struct data_spec is the data module's */
        {"lib/train.c", "numerics.h"}, /* numerics plugs in through struct train_probe */
        {"lib/train.h", "numerics.h"},
    };
    for (size_t i = 0; i < sizeof gone / sizeof gone[0]; i++)
        cr_expect(!includes(gone[i][0], gone[i][1]), "%s includes %s again: an arrow up the layers "
                  "(docs/architecture.md)", gone[i][0], gone[i][1]);
    cr_expect(includes("models/model.h", "data.h"), "models/model.h takes struct data_spec from lib/data.h");
}

/* The source paths (lib/..., models/..., kernels/...) in one table cell, each without its directory. */
static int paths_in(const char *cell, size_t len, char names[][64], int max)
{
    int n = 0;
    for (size_t i = 0; i < len && n < max; i++) {
        bool at = (!strncmp(cell + i, "lib/", 4) || !strncmp(cell + i, "models/", 7) ||
                   !strncmp(cell + i, "kernels/", 8)) && (i == 0 || strchr(" ,(", cell[i - 1]));
        if (!at)
            continue;
        size_t end = i + strcspn(cell + i, " ,)|");
        if (end > len)
            end = len;
        snprintf(names[n++], 64, "%.*s", (int)(end - i), cell + i);
        i = end;
    }
    return n;
}

Test(arrows, every_listed_up_arrow_is_still_there)
{
    char *doc = read_source("docs/architecture.md");
    char *table = strstr(doc, "## Include arrows that go up today");
    cr_assert_not_null(table, "docs/architecture.md has no section \"Include arrows that go up today\"");
    char *end = strstr(table + 1, "\n## ");
    if (end)
        *end = '\0';
    int rows = 0;
    for (char *line = strtok(table, "\n"); line; line = strtok(NULL, "\n")) {
        if (strncmp(line, "| ", 2) != 0 || !strncmp(line, "| from", 6))
            continue;
        const char *from = line + 2;
        size_t from_len = strcspn(from, "|");
        const char *to = from + from_len + 1;
        size_t to_len = strcspn(to, "|");
        char froms[4][64], tos[4][64];
        int nf = paths_in(from, from_len, froms, 4), nt = paths_in(to, to_len, tos, 4);
        cr_assert(nf > 0 && nt > 0, "docs/architecture.md: a row names no source file: %s", line);
        const char *header = strrchr(tos[0], '/') + 1; /* the first one listed: the direct include */
        for (int i = 0; i < nf; i++)
            cr_expect(includes(froms[i], header), "docs/architecture.md lists %s including %s, but it does not: "
                      "remove or correct the row", froms[i], tos[0]);
        rows++;
    }
    cr_expect_gt(rows, 0, "docs/architecture.md's table of up arrows has no rows");
    free(doc);
}
