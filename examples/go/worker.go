// A delayd consumer loop to copy: pop, work, ack or nack with the error, touch long jobs, stop
// gracefully on SIGTERM or Ctrl-C. Standard library only (Go 1.19+).
//
//	DELAYD_URL=http://127.0.0.1:9277 DELAYD_TOKEN=... go run . orders
//
// Replace handle with your work. A job that returns an error is nacked with its text, which
// delayd keeps as the message's last error (GET /v1/messages/{id}, the dashboard, dead letters).
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Message is one popped delivery.
type Message struct {
	ID      string `json:"id"`
	Body    string `json:"body"`
	Receipt string `json:"receipt"`
	Attempt int    `json:"attempt"`
}

// apiError is an answer other than 2xx.
type apiError struct {
	status int
	body   string
}

func (e *apiError) Error() string { return fmt.Sprintf("HTTP %d: %s", e.status, e.body) }

var (
	baseURL = strings.TrimRight(env("DELAYD_URL", "http://127.0.0.1:9277"), "/")
	token   = os.Getenv("DELAYD_TOKEN")
	// How long a popped message stays reserved; long jobs are touched every ttr/3 meanwhile.
	ttr   = time.Duration(envInt("DELAYD_TTR_MS", 30000)) * time.Millisecond
	batch = envInt("DELAYD_BATCH", 10)
	// A pop waits this long for a message; it also bounds how long a stop takes to be noticed.
	wait = 5 * time.Second
	// Go's client follows a cluster's 307 to the leader, with the same method and body.
	client = &http.Client{Timeout: wait + 30*time.Second}
)

func env(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

func envInt(k string, def int) int {
	n, err := strconv.Atoi(os.Getenv(k))
	if err != nil {
		return def
	}
	return n
}

// call sends one request with a JSON body and decodes the JSON answer into out.
func call(method, path string, body, out any) error {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return err
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, baseURL+path, rd)
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode/100 != 2 {
		return &apiError{resp.StatusCode, string(b)}
	}
	if out == nil {
		return nil
	}
	return json.Unmarshal(b, out)
}

// handle is your work. This one understands a few test bodies: {"sleep_ms": N} works N ms,
// {"fail": "why"} fails.
func handle(m Message) error {
	var body struct {
		SleepMs int    `json:"sleep_ms"`
		Fail    string `json:"fail"`
	}
	_ = json.Unmarshal([]byte(m.Body), &body) // a body that is not such JSON is plain work
	time.Sleep(time.Duration(body.SleepMs) * time.Millisecond)
	if body.Fail != "" {
		return errors.New(body.Fail)
	}
	return nil
}

// keepReserved touches the reservation every ttr/3 until done is closed.
func keepReserved(receipt string, done <-chan struct{}) {
	t := time.NewTicker(ttr / 3)
	defer t.Stop()
	for {
		select {
		case <-done:
			return
		case <-t.C:
			body := map[string]any{"receipt": receipt, "ttr_ms": ttr.Milliseconds()}
			if err := call("POST", "/v1/touch", body, nil); err != nil {
				log.Printf("touch failed: %v", err)
			}
		}
	}
}

// settle acks or nacks, retrying while delayd is unreachable or has no leader (503). Any other
// refusal (e.g. 404: the reservation ran out and another consumer has the message) is logged,
// as retrying cannot change it.
func settle(path string, body any) (map[string]any, bool) {
	for attempt := 0; attempt < 10; attempt++ {
		var out map[string]any
		err := call("POST", path, body, &out)
		if err == nil {
			return out, true
		}
		var ae *apiError
		if errors.As(err, &ae) && ae.status != http.StatusServiceUnavailable {
			log.Printf("%s refused: %v", path, err)
			return nil, false
		}
		log.Printf("%s failed: %v", path, err)
		time.Sleep(min(200*time.Millisecond<<attempt, 5*time.Second))
	}
	return nil, false
}

func min(a, b time.Duration) time.Duration {
	if a < b {
		return a
	}
	return b
}

func workOn(m Message) {
	done := make(chan struct{})
	go keepReserved(m.Receipt, done)
	err := handle(m)
	close(done)
	if err != nil {
		msg := err.Error()
		if len(msg) > 2000 {
			msg = msg[:2000]
		}
		if out, ok := settle("/v1/nack", map[string]any{"receipt": m.Receipt, "error": msg}); ok {
			fmt.Printf("%s nacked: %v\n", m.ID, out["state"])
		}
		return
	}
	if _, ok := settle("/v1/ack", map[string]any{"receipt": m.Receipt}); ok {
		fmt.Printf("%s acked\n", m.ID)
	}
}

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: worker TOPIC")
		os.Exit(2)
	}
	topic := os.Args[1]
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	fmt.Printf("worker on %s at %s\n", topic, baseURL)
	path := fmt.Sprintf("/v1/topics/%s/pop?max=%d&wait_ms=%d&ttr_ms=%d", topic, batch, wait.Milliseconds(), ttr.Milliseconds())
	for ctx.Err() == nil {
		var got struct {
			Messages []Message `json:"messages"`
		}
		if err := call("POST", path, nil, &got); err != nil {
			// delayd restarting, a leader election, a network blip: wait, then pop again.
			log.Printf("pop failed: %v", err)
			select {
			case <-ctx.Done():
			case <-time.After(time.Second):
			}
			continue
		}
		// Messages already popped are finished even when a stop comes meanwhile: each is acked
		// or nacked, never left to its time-to-run.
		for _, m := range got.Messages {
			workOn(m)
		}
	}
	fmt.Println("worker stopped")
}
