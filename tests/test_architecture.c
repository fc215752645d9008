/*
 * test_architecture.c — the floors and include arrows docs/architecture.md describes.
 *
 * Each floor (lib/base/ with kernels/ under seam 1, models/, lib/engine/, cmd/) includes only its own folder and
 * the floors below it. CMakeLists.txt compiles each floor seeing only those folders; checked here again from the
 * #include lines, so that a file moved to the wrong folder or an include path added to a floor shows up as the
 * arrow it is. Also: every cycle inside a floor that docs/architecture.md lists is still there (a row whose
 * arrow has gone must go too), and the arrows removed so far (struct data_spec in lib/base/data.h; numerics
 * plugged into the run through lib/engine/train.h's train_probe) do not come back.
 *
 * And the scripts' paths: every `scripts/...` path written in the docs, the tests, the sources, CI and the scripts
 * themselves names a file or folder that exists (scripts/README.md says which folder holds what), so moving a
 * script cannot leave a stale path behind.
 */
#include <criterion/criterion.h>

#include <ctype.h>
#include <dirent.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

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
        {"lib/base/data.h", "model.h"},     /* struct data_spec is the data module's */
        {"lib/engine/train.c", "numerics.h"}, /* numerics plugs in through struct train_probe */
        {"lib/engine/train.h", "numerics.h"},
    };
    for (size_t i = 0; i < sizeof gone / sizeof gone[0]; i++)
        cr_expect(!includes(gone[i][0], gone[i][1]), "%s includes %s again: an arrow up the layers "
                  "(docs/architecture.md)", gone[i][0], gone[i][1]);
    cr_expect(includes("models/model.h", "data.h"), "models/model.h takes struct data_spec from lib/base/data.h");
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

Test(arrows, every_listed_cycle_is_still_there)
{
    char *doc = read_source("docs/architecture.md");
    char *table = strstr(doc, "## Cycles inside a floor");
    cr_assert_not_null(table, "docs/architecture.md has no section \"Cycles inside a floor\"");
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
    cr_expect_gt(rows, 0, "docs/architecture.md's table of cycles has no rows");
    free(doc);
}

/* ---- the floors ------------------------------------------------------------------------------------------ */

/* A floor: its folders, and the folders its files may include from (its own and those of the floors below). */
struct floor {
    const char *name;
    const char *dirs[3];
    const char *sees[6];
};

static const struct floor floors[] = {
    {"the ground floor", {"lib/base"}, {"lib/base"}},
    {"the CPU backend", {"kernels/cpu"}, {"kernels/cpu", "lib/base"}},
    {"the CUDA backend", {"kernels/cuda"}, {"kernels/cuda", "lib/base"}},
    {"models", {"models"}, {"models", "lib/base"}},
    {"the engine", {"lib/engine"}, {"lib/engine", "models", "lib/base"}},
    {"the commands", {"cmd"}, {"cmd", "lib/engine", "models", "lib/base"}},
};

static bool header_in(const char *dir, const char *name, size_t len)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s/%.*s", AMP_SOURCE_DIR, dir, (int)len, name);
    FILE *f = fopen(path, "rb");
    if (f)
        fclose(f);
    return f != NULL;
}

/* The folder (of the whole tree's source folders) that holds header `name`, or NULL: a system header. */
static const char *home_of(const char *name, size_t len)
{
    static const char *const all[] = {"lib/base", "lib/engine", "models", "kernels/cpu", "kernels/cuda", "cmd"};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (header_in(all[i], name, len))
            return all[i];
    return NULL;
}

/* Checks every `#include "..."` of file dir/name against the folders floor f may see; returns the includes. */
static int check_file(const struct floor *f, const char *dir, const char *name)
{
    char rel[512];
    snprintf(rel, sizeof rel, "%s/%s", dir, name);
    char *text = read_source(rel);
    int n = 0;
    for (char *line = text; line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL) {
        line += strspn(line, " \t");
        if (strncmp(line, "#include \"", 10) != 0)
            continue;
        const char *inc = line + 10;
        size_t len = strcspn(inc, "\"");
        const char *home = home_of(inc, len);
        bool seen = home == NULL;
        for (int s = 0; s < 6 && f->sees[s] && !seen; s++)
            seen = !strcmp(home, f->sees[s]);
        cr_expect(seen, "%s (%s) includes %.*s from %s: an arrow up the floors (docs/architecture.md)", rel,
                  f->name, (int)len, inc, home);
        n++;
    }
    free(text);
    return n;
}

Test(floors, each_floor_includes_only_itself_and_the_floors_below)
{
    int files = 0, arrows = 0;
    for (size_t i = 0; i < sizeof floors / sizeof floors[0]; i++)
        for (int d = 0; d < 3 && floors[i].dirs[d]; d++) {
            char path[512];
            snprintf(path, sizeof path, "%s/%s", AMP_SOURCE_DIR, floors[i].dirs[d]);
            DIR *dir = opendir(path);
            cr_assert_not_null(dir, "cannot list %s", path);
            for (struct dirent *e; (e = readdir(dir));) {
                const char *dot = strrchr(e->d_name, '.');
                if (!dot || (strcmp(dot, ".c") && strcmp(dot, ".h") && strcmp(dot, ".cu")))
                    continue;
                arrows += check_file(&floors[i], floors[i].dirs[d], e->d_name);
                files++;
            }
            closedir(dir);
        }
    cr_expect_gt(files, 100, "found only %d source files: the floors' folders moved?", files);
    cr_expect_gt(arrows, 200, "found only %d includes", arrows);
}

/* lib/ holds the two floors' folders and nothing else: a file at lib/'s top would belong to no floor. */
Test(floors, lib_holds_only_the_two_floors)
{
    char path[512];
    snprintf(path, sizeof path, "%s/lib", AMP_SOURCE_DIR);
    DIR *dir = opendir(path);
    cr_assert_not_null(dir, "cannot list %s", path);
    for (struct dirent *e; (e = readdir(dir));)
        cr_expect(!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..") || !strcmp(e->d_name, "base") ||
                  !strcmp(e->d_name, "engine"), "lib/%s: every file of lib/ belongs to lib/base/ (the ground "
                  "floor) or lib/engine/ (the run; docs/architecture.md)", e->d_name);
    closedir(dir);
}

/* ---- every scripts/ path written anywhere names something that exists ------------------------------------ */

/* Whether `rel` (relative to the source tree) exists, as a file or a folder. */
static bool source_exists(const char *rel)
{
    char path[768];
    struct stat st;
    snprintf(path, sizeof path, "%s/%s", AMP_SOURCE_DIR, rel);
    return stat(path, &st) == 0;
}

/* Each `scripts/...` path in text file `rel` that does not exist fails the test, naming file, line and path.
 * A path is `scripts/` not preceded by a name character, then name characters and slashes; trailing dots (the
 * end of a sentence) are dropped; a pattern (`scripts/bench_*.sh`, `scripts/{a,b}`, `scripts/$X`) is skipped.
 * Returns how many paths were checked. */
static int check_scripts_paths(const char *rel)
{
    char path[768];
    snprintf(path, sizeof path, "%s/%s", AMP_SOURCE_DIR, rel);
    struct stat st;
    cr_assert(stat(path, &st) == 0, "cannot stat %s", path);
    char *text = read_source(rel);
    int checked = 0;
    if (strlen(text) != (size_t)st.st_size && st.st_size < (1 << 20) - 1) { /* a NUL inside: not text */
        free(text);
        return 0;
    }
    for (char *at = strstr(text, "scripts/"); at; at = strstr(at + 1, "scripts/")) {
        if (at > text && (isalnum((unsigned char)at[-1]) || at[-1] == '_' || at[-1] == '-' || at[-1] == '.'))
            continue;
        size_t len = strspn(at, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_./-");
        if (strchr("*{$%[", at[len]) && at[len] != '\0')
            continue;
        while (len > 0 && at[len - 1] == '.')
            len--;
        char name[512];
        snprintf(name, sizeof name, "%.*s", (int)len, at);
        int line = 1;
        for (const char *c = text; c < at; c++)
            line += *c == '\n';
        cr_expect(source_exists(name), "%s:%d names %s, which does not exist: write the path where the script is "
                  "now (scripts/README.md)", rel, line, name);
        checked++;
    }
    free(text);
    return checked;
}

/* The text files under folder `rel` (recursively; build outputs, hidden folders and fuzz corpora are not text
 * anyone reads as docs). Returns how many paths were checked. */
static int check_scripts_paths_under(const char *rel)
{
    char path[768];
    snprintf(path, sizeof path, "%s/%s", AMP_SOURCE_DIR, rel);
    DIR *dir = opendir(path);
    cr_assert_not_null(dir, "cannot list %s", path);
    int checked = 0;
    for (struct dirent *e = readdir(dir); e; e = readdir(dir)) {
        if (e->d_name[0] == '.' || !strcmp(e->d_name, "corpus") || !strncmp(e->d_name, "build", 5) ||
            !strcmp(e->d_name, "__pycache__"))
            continue;
        char child[512];
        snprintf(child, sizeof child, "%s/%s", rel, e->d_name);
        snprintf(path, sizeof path, "%s/%s", AMP_SOURCE_DIR, child);
        struct stat st;
        if (stat(path, &st) != 0)
            continue;
        if (S_ISDIR(st.st_mode))
            checked += check_scripts_paths_under(child);
        else if (S_ISREG(st.st_mode))
            checked += check_scripts_paths(child);
    }
    closedir(dir);
    return checked;
}

Test(paths, every_scripts_path_exists)
{
    static const char *const files[] = {"README.md", "CONTRIBUTING.md", "CMakeLists.txt", ".ci/run"};
    static const char *const folders[] = {"docs", "tests", "scripts", "lib", "models", "kernels", "cmd", "configs"};
    int checked = 0;
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++)
        checked += check_scripts_paths(files[i]);
    for (size_t i = 0; i < sizeof folders / sizeof folders[0]; i++)
        checked += check_scripts_paths_under(folders[i]);
    /* README's two commands alone are four paths: a count this low means the scan itself broke */
    cr_expect_gt(checked, 100, "only %d scripts/ paths found in the tree: the scan is broken", checked);
}
